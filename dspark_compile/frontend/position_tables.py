"""How far a captured model's position tables reach: the context a state may be sized for.

A model with learned absolute positions (GPT-2, OPT, GPT-Neo, BioGPT, GPT) or another table
indexed by position reads row ``f(position)`` of a fixed table. Past its last row HF's own forward
fails, a CPU gather raises, and a GPU gather reads out of bounds: a wrong answer or a dead
device, never a refusal. :func:`position_limit` finds every gather in the dense graph whose
indices are computed from the positions alone, evaluates that computation on the positions
``0, 1, 2, ...`` and returns the first position whose row falls outside its table (or None where
no table bounds the positions), so ``Verifier.new_state`` refuses a ``max_context`` past it
before anything runs.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..graph_inputs import InputKind
from ..specs import PositionLimit
from .evaluate import evaluate_node

__all__ = ["PositionLimit", "position_limit", "tightest", "token_id_limit"]

log = logging.getLogger("dspark_compile")

_GATHERS = {
    "aten.embedding.default": lambda node: [(node.args[0], node.args[1], 0)],
    "aten.index_select.default": lambda node: [(node.args[0], node.args[2], node.args[1])],
    "aten.gather.default": lambda node: [(node.args[0], node.args[2], node.args[1])],
    "aten.index.Tensor": lambda node: [(node.args[0], index, dim)
                                       for dim, index in enumerate(node.args[1]) if index
                                       is not None],
}
"""Gathers by target: ``node -> [(table, indices, dim)]``."""

_PROBE_PAST = 64
"""Positions probed past a table's rows (a table read modulo its rows has no limit)."""


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _serves(gm: fx.GraphModule, index: fx.Node, source: fx.Node, rows: int) -> int | None:
    """How many values ``0..P-1`` of the input ``source`` (the positions, or the token ids)
    the gather serves: the largest ``P`` (up to ``rows`` + :data:`_PROBE_PAST`) whose indices
    all lie in ``0..rows-1``, found by bisection (a token-wise graph computes each token's
    indices from that token's value alone, however it repeats or broadcasts them, so a prefix
    that fits stays fitting); None where the computation cannot be evaluated."""
    val = source.meta["val"]

    def fits(count: int) -> bool | None:
        probe = torch.arange(count, dtype=val.dtype, device=val.device)[None]
        try:  # every input of the computation is the source (_bounded_tables checks)
            got = evaluate_node(gm, index, {source: probe})
        except Exception:  # noqa: BLE001 - a computation that needs the trace is not evaluated
            return None
        if not isinstance(got, torch.Tensor):
            return None
        return bool(((got >= 0) & (got < rows)).all())

    low, high = 0, rows + _PROBE_PAST  # fits(low) holds (no values); find the last that fits
    top = fits(high)
    if top is None:
        return None
    if top:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        ok = fits(mid)
        if ok is None:
            return None
        low, high = (mid, high) if ok else (low, mid)
    return low


def _bounded_tables(gm: fx.GraphModule, kind: InputKind, what: str
                    ) -> list[tuple[int, str, int]]:
    """``[(served, table name, rows)]`` of every table ``gm`` gathers at indices computed from
    its ``kind`` input alone (``what`` names it), where the table serves fewer values than its
    rows plus :data:`_PROBE_PAST`; empty where that input is not ``[bs, T]``. A gather whose
    indices cannot be evaluated outside the trace refuses the model by name."""
    source = next((n for n in gm.graph.find_nodes(op="placeholder")
                   if n.meta["dspark_input"].kind == kind), None)
    if source is None or source.meta["val"].dim() != 2:
        return []  # mRoPE's [3, bs, T] positions only become rotary angles (flat_mrope)
    if source.meta["val"].device.type == "meta":
        log.warning("dspark_compile: the model is on the meta device, so the %s its tables "
                    "serve were not computed (nothing bounds them)", what)
        return []
    found = []
    for node in gm.graph.nodes:
        gather = _GATHERS.get(str(node.target)) if node.op == "call_function" else None
        for table, index, dim in (gather(node) if gather else ()):
            if not isinstance(index, fx.Node) or not isinstance(table, fx.Node):
                continue
            if {n for n in _ancestors(index) | {index} if n.op == "placeholder"} != {source}:
                continue  # another input decides it too, or none does
            rows = table.meta["val"].shape[dim]
            if not isinstance(rows, int):
                continue  # a table whose length follows the batch is built per step, not read
            serves = _serves(gm, index, source, rows)
            if serves is None:
                raise NotImplementedError(
                    f"dspark_compile: {node.name} gathers rows of {table.name} at indices "
                    f"computed from the {what} in a way that cannot be evaluated outside the "
                    f"trace, so the {what} its table serves are unknown; the model is refused "
                    "rather than read out of bounds")
            if serves < rows + _PROBE_PAST:
                spec = table.meta.get("dspark_input")
                found.append((serves, spec.name if spec else table.name, rows))
    return found


def position_limit(gm: fx.GraphModule) -> PositionLimit | None:
    """The tightest :class:`PositionLimit` of ``gm``'s position-indexed tables (module
    docstring); None where no table is read at a position."""
    return tightest(*(PositionLimit(serves, name, rows) for serves, name, rows in
                      _bounded_tables(gm, InputKind.POSITIONS, "positions")))


def token_id_limit(gm: fx.GraphModule) -> tuple[int, str] | None:
    """``(ids, table)``: how many token ids ``0..ids-1`` every table the dense graph reads at
    indices computed from the token ids alone can serve, and the tightest table's name; None
    where every such table serves past its rows (ids clamped or masked into it, as Gemma 3n's
    per-layer table is in later transformers) or none is read. A second table of fewer rows
    than the input embedding (Gemma 3n's per-layer inputs in transformers 5.17, indexed by the
    raw ids) would otherwise be read out of bounds by an id the embedding accepts. A gather
    whose indices cannot be evaluated outside the trace refuses the model by name."""
    found = _bounded_tables(gm, InputKind.INPUT_IDS, "token ids")
    return min(((serves, name) for serves, name, _ in found), key=lambda x: x[0],
               default=None)


def tightest(*limits: PositionLimit | None) -> PositionLimit | None:
    """The limit with the fewest positions (the first of equals), None where none is set."""
    given = [x for x in limits if x is not None]
    return min(given, key=lambda x: x.positions) if given else None
