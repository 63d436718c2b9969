"""What every pass shares: its context, its result, and how it refuses an op."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from ..config import ResolvedConfig

__all__ = ["PassContext", "PassResult", "RefusedOp", "source_line", "EnsureError"]


@dataclass
class PassContext:
    """State handed from pass to pass."""

    bs: sympy.Symbol
    """Symbol of the request axis in the dense graph."""
    tokens: sympy.Symbol
    """Symbol of the per-request token axis ``T`` in the dense graph."""
    inputs: list
    """``InputSpec`` per placeholder, in order; passes that add inputs append here."""
    settings: ResolvedConfig = field(default_factory=ResolvedConfig)
    """The resolved configuration (which optional passes run, the lowering); the default is the
    CPU reference's."""


@dataclass
class PassResult:
    """What one pass did."""

    name: str
    changed: int
    """Nodes rewritten (0 for an analysis)."""
    details: dict = field(default_factory=dict)
    """Counts by kind, e.g. labels found or ops replaced."""
    rewrites: list[tuple[str, str]] = field(default_factory=list)
    """(what was rewritten, model source line) pairs for ``explain()``."""


class EnsureError(AssertionError):
    """A pass's stated postcondition does not hold: the pass is wrong, not the model."""


_OWN_FILES = f"{os.sep}dspark_compile{os.sep}"
_TORCH_FILES = os.path.dirname(torch.__file__) + os.sep


def source_line(node: fx.Node) -> str:
    """The innermost model source line that produced ``node`` (from its stack trace).

    Frames inside dspark_compile itself (the capture, ``nn.CachedAttention``) are skipped, and
    so are torch's own modules (``nn.Linear.forward``) while a frame outside them exists: the
    line a user needs is the one in their model (``self.q_proj(hidden_states)``).
    """
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for skip in ((_OWN_FILES, _TORCH_FILES), (_OWN_FILES,)):
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith("File ") and not any(s in lines[i] for s in skip):
                code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith(
                    "File ") else ""
                where = lines[i].split("site-packages" + os.sep, 1)[-1] if "site-packages" in \
                    lines[i] else lines[i]
                return f"{where}: {code}".rstrip(": ")
    return "<no source line recorded>"


class RefusedOp(RuntimeError):
    """An op that no pass can rewrite; raised at compile time, never silently skipped."""

    def __init__(self, node: fx.Node, why: str) -> None:
        self.node = node
        self.why = why
        target = getattr(node.target, "__name__", str(node.target))
        super().__init__(
            f"dspark_compile refuses {target} (graph node {node.name}): {why}.\n"
            f"  at {source_line(node)}\n"
            "  Every op outside cached attention must treat each token row on its own. Rewrite "
            "this computation per token (or route sequence mixing through "
            "dspark_compile.nn.CachedAttention / the model's attention interface)."
        )


def is_op(node: fx.Node, packet) -> bool:
    """``node`` calls any overload of op ``packet`` (matching by packet, never one overload)."""
    return node.op == "call_function" and (
        node.target is packet or getattr(node.target, "overloadpacket", None) is packet)


def check_rewritten(gm: fx.GraphModule, dense, ragged, result: PassResult) -> None:
    """Ensure of a dense -> ragged rewrite: no ``dense`` call is left, and the graph holds as
    many ``ragged`` calls as the pass says it wrote."""
    left = [n.name for n in gm.graph.nodes if is_op(n, dense)]
    if left:
        raise EnsureError(f"{result.name}: {dense} left in the graph: {left}")
    found = sum(1 for n in gm.graph.nodes if is_op(n, ragged))
    if found != result.changed:
        raise EnsureError(f"{result.name}: rewrote {result.changed} calls but the graph has "
                          f"{found} {ragged}")
