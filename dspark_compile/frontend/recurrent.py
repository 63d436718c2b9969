"""Recurrent mixers found from what their forward calls, not from their attribute names.

transformers' linear-attention and state-space mixers (Gated DeltaNet, Mamba-2, short convs)
mix tokens only through a few *module-level* functions of their modeling module
(``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ...). While a
capture runs, ``frontend/hybrid.py`` replaces those functions; each replacement asks
:class:`RecurrentLayers` which module is calling (the innermost module whose forward is running,
tracked by hooks on every module of the model) and:

* during the discovery forward (``CaptureScope.discovered`` is set; no pools exist yet) records
  what the call's shapes say about that module's state and returns zeros. When the module's
  forward returns, its calls decide its kind: ``causal_conv1d_fn`` + a gated delta rule is a
  Gated DeltaNet layer, ``causal_conv1d_fn`` + ``mamba2_chunk_scan`` a Mamba-2 layer,
  ``causal_conv1d_fn`` alone a short-conv layer (LFM2); anything else is refused naming the
  module. Layers are numbered in the order their forwards return; a module whose forward runs
  more than once in one model forward (a looped block, Inkling 2 Loop) is one layer, with a
  state of its own, per run; a Mamba-1 mixer that scans once per head (Zamba) is a layer for
  its conv and first scan and a ``"scan"`` layer for each further scan.
* during the capture emits the dense op over that layer's pools (``CaptureScope.conv`` /
  ``gated_delta_rule`` / ``ssd``).

A module that runs a causal depthwise ``nn.Conv1d`` over the tokens itself (a mixer written
without those functions, or an older transformers) is refused naming it: its conv window would
be state nobody owns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

from torch import nn

from ..specs import LinearSpec
from .scope import CaptureScope, active_scope

__all__ = ["RecurrentLayers", "Site", "check_linear_calls"]

KINDS = {frozenset({"conv", "gdn"}): "gdn", frozenset({"conv", "ssd"}): "ssd",
         frozenset({"conv"}): "conv", frozenset({"scan"}): "scan"}
"""Calls one mixer's forward makes -> its kind (``LinearSpec.kind``). ``"scan"`` is recorded
only by MiniMax's lightning forward (``frontend/minimax.py``): a Mamba-2 scan without its conv
stays refused."""
EXPECTED = {"gdn": ["conv", "gdn"], "ssd": ["conv", "ssd"], "conv": ["conv"],
            "scan": ["ssd"]}
"""Kind -> the calls a layer of that kind makes per forward, in order."""


@dataclass
class Site:
    """One call of a replaced function, attributed to the module that made it."""

    scope: CaptureScope
    module: nn.Module
    where: str
    """``"<Class> '<qualified name>' (<function>)"`` for messages."""
    layer: int | None
    """The module's linear-layer index (None while discovering)."""

    @property
    def discovering(self) -> bool:
        return self.scope.discovered is not None


@dataclass
class RecurrentLayers:
    """The recurrent mixers of one model (see the module docstring)."""

    model: nn.Module
    specs: list[LinearSpec] = field(default_factory=list)
    """One per mixer, in layer order; filled in place by the discovery forward (the adapter's
    ``linear_specs`` is this list)."""
    index: dict[int, list[int]] = field(default_factory=dict)
    """``id(module)`` -> the layer index of each of its forward's runs, in order."""
    _names: dict[int, str] = field(default_factory=dict)
    _stack: list[nn.Module] = field(default_factory=list)
    _pending: dict[int, dict[str, tuple]] = field(default_factory=dict)
    _discovery: object = None
    _capture: object = None
    _runs: dict[int, int] = field(default_factory=dict)
    """Runs so far of each layer module's forward in the capture forward ``_capture``."""
    _scans: dict[int, int] = field(default_factory=dict)
    """Scans so far in each layer module's current run (Zamba: one a mamba head)."""

    def __post_init__(self) -> None:
        self._names = {id(m): name for name, m in self.model.named_modules()}

    def name(self, module: nn.Module) -> str:
        return f"{type(module).__name__} {self._names.get(id(module), '?')!r}"

    # ---------------------------------------------------------------- attribution
    def site(self, function: str, scan: bool = False) -> Site:
        """The scope and module of a call of ``function`` (a replaced modeling function).
        ``scan``: a Mamba-1 scan, of which one run may make several (each its own layer, after
        the run's first: :meth:`record`)."""
        scope = active_scope()
        if scope is None:
            raise RuntimeError(
                f"{function} was replaced by dspark_compile and runs only inside a capture; "
                "the original is restored when the capture ends")
        if not self._stack:
            raise NotImplementedError(
                f"{function} was called outside any module's forward during a dspark_compile "
                "capture; only a mixer module's own call can be given a state pool")
        module = self._stack[-1]
        where = f"{self.name(module)} ({function})"
        if scope.discovered is not None:
            if self._discovery is not scope:  # a new discovery forward: start over
                self._discovery = scope
                self.specs.clear()
                self.index.clear()
                self._pending.clear()
            return Site(scope, module, where, None)
        runs, run = self.index.get(id(module), []), self._runs.get(id(module), 0)
        if not 1 <= run <= len(runs):
            raise RuntimeError(
                f"{where} was called during the capture in run {run} of its forward but made "
                f"such calls in {len(runs)} runs when the model's layers were discovered; the "
                "forward must make the same calls every time")
        layer = runs[run - 1]
        if scan:  # the run's k-th scan: the layers after its first are its scans 1, 2, ...
            k = self._scans.get(id(module), 0)
            self._scans[id(module)] = k + 1
            layer += k
        return Site(scope, module, where, layer)

    def record(self, site: Site, kind: str, shape: tuple, dtype=None,
               repeats: bool = False) -> None:
        """Discovery: ``site``'s module made a ``kind`` call whose state has ``shape`` (a conv:
        and its input ``dtype``). ``repeats``: a call a run may make several times (Mamba-1
        scans, one a head): each after the first becomes a ``"scan"`` layer of its own."""
        calls = self._pending.setdefault(id(site.module), {})
        if kind in calls and repeats and "scans" in calls:
            calls["scans"].append(shape)
            return
        if kind in calls:
            raise NotImplementedError(
                f"{site.where} made a second {kind!r} call in one forward; dspark_compile owns "
                "one state per mixer, so a module that mixes tokens through two of them is "
                "refused (several Mamba-1 scans of one mixer, Zamba's heads, are the exception)")
        if repeats:
            calls["scans"] = []  # later calls of this run, each a "scan" layer of its own
        calls[kind] = shape
        if dtype is not None:
            calls[f"{kind}_dtype"] = dtype

    def _finish(self, module: nn.Module) -> None:
        """Discovery: ``module``'s forward returned; its calls make it a layer (or a refusal)."""
        calls = self._pending.pop(id(module), None)
        if not calls:
            return
        conv_dtype = calls.pop("conv_dtype", None)
        scans = calls.pop("scans", [])
        if conv_dtype == next(self.model.parameters()).dtype:
            conv_dtype = None  # the model's: the state takes the model dtype
        kind = KINDS.get(frozenset(calls))
        if kind is None:
            raise NotImplementedError(
                f"{self.name(module)} mixes tokens through {sorted(calls)} in one forward; "
                "dspark_compile captures a causal_conv1d_fn call followed by a gated delta "
                "rule or a mamba2_chunk_scan call, a causal_conv1d_fn call alone, or MiniMax's "
                "lightning scan alone, and refuses any other mixer")
        conv_dim, width = calls.get("conv", (0, 0))  # a lightning scan: no conv window
        heads = (0, 0, 0) if kind == "conv" else calls[kind]
        runs = self.index.setdefault(id(module), [])
        name = self._names.get(id(module), "?") + (f"[run {len(runs)}]" if runs else "")
        runs.append(len(self.specs))
        self.specs.append(LinearSpec(conv_dim, width, *heads, kind=kind, name=name,
                                     conv_dtype=conv_dtype))
        for k, shape in enumerate(scans, 1):  # a mixer's further scans: no conv window
            self.specs.append(LinearSpec(0, 0, *shape, kind="scan", name=f"{name}[scan {k}]"))

    # ---------------------------------------------------------------- module tracking
    def _enter(self, module: nn.Module, args) -> None:
        if isinstance(module, nn.Conv1d) and _causal_depthwise(module) and self._stack:
            owner = self._stack[-1]
            raise NotImplementedError(
                f"{self.name(owner)} runs a causal depthwise nn.Conv1d "
                f"({self.name(module)}) over the tokens itself instead of calling its modeling "
                "module's causal_conv1d_fn; dspark_compile could not own its conv window, so "
                "the model is refused")
        self._stack.append(module)
        if id(module) in self.index:  # a layer module: count its runs in this capture forward
            scope = active_scope()
            if scope is not None and scope.discovered is None:
                if self._capture is not scope:
                    self._capture, self._runs = scope, {}
                self._runs[id(module)] = self._runs.get(id(module), 0) + 1
                self._scans[id(module)] = 0

    def _exit(self, module: nn.Module, args, output) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        if self._discovery is not None and active_scope() is self._discovery:
            self._finish(module)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Hooks on every module of the model that keep the stack of running forwards."""
        handles = []
        try:
            for m in self.model.modules():
                handles.append(m.register_forward_pre_hook(self._enter))
                handles.append(m.register_forward_hook(self._exit, always_call=True))
            yield
        finally:
            for h in handles:
                h.remove()
            self._stack.clear()


def _causal_depthwise(conv: nn.Conv1d) -> bool:
    """A conv that mixes tokens causally, channel by channel (a recurrent mixer's window)."""
    width = conv.kernel_size[0]
    return width > 1 and conv.groups == conv.in_channels and conv.padding == (width - 1,)


def check_linear_calls(scope: CaptureScope, specs: list[LinearSpec]) -> None:
    """After a captured forward: every linear layer made exactly the calls of its kind."""
    made: dict[int, list[str]] = {}
    for layer, kind in scope.linear_calls:
        made.setdefault(layer, []).append(kind)
    for i, spec in enumerate(specs):
        if made.get(i, []) != EXPECTED[spec.kind]:
            raise RuntimeError(
                f"linear layer {i} ({spec.name}, {spec.kind}) made the calls "
                f"{made.get(i, [])} while captured but {EXPECTED[spec.kind]} when the model's "
                "layers were discovered; the forward must make the same calls every time")
