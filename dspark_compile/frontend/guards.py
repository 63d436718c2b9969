"""Where a shape guard on ``bs`` or ``T`` came from: the model's source line, not torch's.

A guard records only the frame that evaluated it (``ShapeGuard.sloc``). When the model's own
Python branches on a size, that frame is the model's line (Jamba's selective scan loops over
``range(seq_len)``: ``Eq(T, 5)`` at ``modeling_jamba.py:... in mamba_selective_scan``). When an
op's fake kernel branches, it is a frame inside torch (LFM2's and Jamba's ``conv1d`` pick a
backend by batch size: ``bs < 16`` at ``_subclasses/fake_impls.py:... in conv``), which tells
the user nothing. For those, :func:`locate` replays the captured graph op by op on fresh size
symbols with the same sample sizes; the op that raises the same guard again made it, and its
recorded stack trace (``record_stack_traces``) names the model line that called it::

    guard bs < 16 at transformers/models/lfm2/modeling_lfm2.py:374 in forward:
        hidden_states = causal_conv1d_fn(...)   (raised inside torch by aten.convolution.default)
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import traceback

import sympy
import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._pytree import tree_map_only

__all__ = ["describe", "locate", "needs_locating", "token_names"]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_HF_MODELS = os.sep.join(("transformers", "models", ""))
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def token_names(bs: sympy.Symbol, tokens: sympy.Symbol) -> dict:
    """Substitution that prints the size symbols as ``bs`` and ``T``."""
    return {bs: sympy.Symbol("bs", integer=True), tokens: sympy.Symbol("T", integer=True)}


def _short(path: str) -> str:
    """A path from its package down (``transformers/models/...``), or as it is."""
    for root in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if root in path:
            return path.split(root, 1)[1]
    return path


def _inside_torch_or_us(path: str) -> bool:
    return path.startswith(_TORCH) or path.startswith(_OWN)


def _frame_text(path: str, line: int, func: str) -> str:
    code = linecache.getline(path, line).strip()
    return f"{_short(path)}:{line} in {func}" + (f": {code}" if code else "")


def _framework_frame(guard) -> tuple[str, int, str] | None:
    """``(file, line, function)`` of the frame that evaluated ``guard``, if recorded."""
    loc = getattr(guard.sloc, "framework_loc", None)
    if isinstance(loc, traceback.FrameSummary):
        return loc.filename, loc.lineno or 0, loc.name
    return None


def _model_frame(node: fx.Node) -> tuple[str, int, str] | None:
    """The innermost frame of ``node``'s recorded stack in a Hugging Face model's own module
    (``transformers/models/...``), else the innermost outside torch and dspark_compile (a
    transformers helper, a plain model's file)."""
    frames = [(m["file"], int(m["line"]), m["func"])
              for m in _FRAME.finditer(node.meta.get("stack_trace") or "")]
    outside = [f for f in frames if not _inside_torch_or_us(f[0])]
    models = [f for f in outside if _HF_MODELS in f[0]]
    return (models or outside or [None])[-1]


def locate(gm: fx.GraphModule, shape_env: ShapeEnv, guards: list) -> dict[int, fx.Node]:
    """For each of ``guards`` (indices into ``shape_env.guards``) evaluated inside torch or
    dspark_compile, the graph node whose op raises the same guard when the graph is replayed
    on fresh symbols. Guards it cannot pin to one op are left out."""
    wanted = {i: shape_env.guards[i].expr for i in guards}
    found: dict[int, fx.Node] = {}
    if not wanted:
        return found
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    back: dict[sympy.Symbol, sympy.Symbol] = {}  # fresh symbol -> the capture's symbol
    fresh: dict[sympy.Symbol, torch.SymInt] = {}

    def size(s):
        if not isinstance(s, torch.SymInt):
            return int(s)
        expr = getattr(s.node, "_expr", s.node.expr)  # before replacement (a specialised T)
        if not isinstance(expr, sympy.Symbol):
            raise _Unreplayable(expr)
        if expr not in fresh:
            hint = int(s.node.hint)
            source = ConstantSource(f"dspark_replay_{expr}")
            symbol = env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
            fresh[expr] = env.create_symintnode(symbol, hint=hint, source=source)
            back[symbol] = expr
        return fresh[expr]

    def like(t):
        if not isinstance(t, torch.Tensor):
            return t
        with mode:
            return torch.empty([size(s) for s in t.shape], dtype=t.dtype, device=t.device)

    values: dict[fx.Node, object] = {}
    try:
        with torch.no_grad(), enable_python_dispatcher():
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    values[node] = like(node.meta.get("val"))
                elif node.op == "get_attr":
                    values[node] = like(functools.reduce(getattr, node.target.split("."), gm))
                elif node.op == "call_function":
                    args, kwargs = tree_map_only(fx.Node, values.__getitem__,
                                                 (node.args, node.kwargs))
                    before = len(env.guards)
                    with mode:
                        values[node] = node.target(*args, **kwargs)
                    for g in env.guards[before:]:
                        expr = g.expr.xreplace(back)
                        for i, want in wanted.items():
                            if i not in found and (expr == want or str(expr) == str(want)):
                                found[i] = node
                    if len(found) == len(wanted):
                        break
    except Exception:  # noqa: BLE001 - a replay that fails only loses the better location
        pass
    return found


class _Unreplayable(Exception):
    """A placeholder size the replay cannot make fresh (an expression, not one symbol)."""


def describe(guard, node: fx.Node | None, names: dict, expr=None) -> str:
    """``guard`` (or ``expr``, its simplified form; printed with ``names``) and the model line
    that raised it: the line of ``node`` (from :func:`locate`) or the guard's own frame."""
    text = str((guard.expr if expr is None else expr).xreplace(names))
    if node is not None:
        frame = _model_frame(node)
        if frame is not None:
            return f"guard {text} at {_frame_text(*frame)} (raised inside torch by {node.target})"
    frame = _framework_frame(guard)
    if frame is not None:
        where = _frame_text(*frame)
        if _inside_torch_or_us(frame[0]):
            return f"guard {text} at {where} (inside torch; no model line found)"
        return f"guard {text} at {where}"
    return f"guard {text} at {guard.sloc}"


def needs_locating(guard) -> bool:
    """The guard's recorded frame is inside torch or dspark_compile, not the model's code."""
    frame = _framework_frame(guard)
    return frame is None or _inside_torch_or_us(frame[0])
