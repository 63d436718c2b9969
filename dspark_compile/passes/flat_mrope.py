"""flat_mrope: multimodal rotary positions ``[3, bs, T]`` -> flat rows ``[3, bs*T]``.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate by three position ids per token. The dense graph
takes them as ``positions [3, bs, T]``; this pass replaces that input with
``mrope_positions [3, bs*T]`` (one column per packed row, which the verifier fills on the
device: ``context_lens[i] + j + mrope_deltas[i]`` in all three rows, found by a search over
``query_start_loc``, or a prefill's explicit rows) and views it back, so the graph still runs
on a uniform layout and ``flatten_tokens`` turns the view into ``[3, N]``. Matches::

    %expand = aten.expand.default(%positions, [3, -1, -1])        # positions [3, bs, T]
    %unsqueeze_1 = aten.unsqueeze.default(%expand, 3)
    %_to_copy = aten._to_copy.default(%unsqueeze_1, dtype=torch.float32)
    %mul = aten.mul.Tensor(%_to_copy, %rotary_emb_inv_freq)       # [3, bs, T, D/2]
    %cos = aten.cos.default(%mul)

Writes::

    %view = aten.view.default(%mrope_positions, [3, %bs, %T])     # mrope_positions [3, bs*T]
    %expand = aten.expand.default(%view, [3, -1, -1])
    ...

The positions must only become rotary angles: every op between the input and a ``cos`` /
``sin`` must move data, cast it or scale it by a weight (``inv_freq``); the section
recomposition after the angles (chunked ``split`` + ``select`` for Qwen2/2.5-VL, interleaved
``slice(..., step=3)`` copies for Qwen3-VL) is token-wise and was proven so by
``token_axis``. Anything else done with the positions (a reduction over the sections, a
comparison, a lookup table) is refused: the verifier's positions would not be what that code
expects.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.proxy import GraphAppendingTracer

from .base import EnsureError, PassContext, PassResult, RefusedOp, source_line
from ..graph_inputs import InputSpec, find_input
from .retrace import copy_module, interpret, placeholder_values, retrace

__all__ = ["run", "MRopeRefused"]

aten = torch.ops.aten

_CARRY = {aten.expand, aten.unsqueeze, aten.view, aten._unsafe_view, aten.reshape, aten.clone,
          aten._to_copy, aten.alias, aten.detach, aten.transpose, aten.permute, aten.slice,
          aten.select, aten.contiguous, aten.mul, aten.bmm, aten.mm}
"""Ops the positions may pass through before they are angles: data movement, casts, the
``inv_freq`` product (``mul`` on 5.24, ``expand @ positions`` as ``bmm`` on 5.17)."""
_ANGLES = {aten.cos, aten.sin}


class MRopeRefused(RefusedOp):
    """The model computes something from its mRoPE positions other than rotary angles."""

    def __init__(self, node: fx.Node, why: str) -> None:
        RuntimeError.__init__(
            self, f"dspark_compile refuses {getattr(node.target, '__name__', node.target)} "
            f"(graph node {node.name}): {why}.\n  at {source_line(node)}")
        self.node, self.why = node, why


def _packet(node: fx.Node):
    return getattr(node.target, "overloadpacket", node.target)


def _angles(positions: fx.Node) -> list[fx.Node]:
    """The cos/sin nodes the positions reach; refuses any other use on the way."""
    found, todo, seen = [], list(positions.users), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        packet = _packet(node)
        val = node.meta.get("val")
        if not isinstance(val, (torch.Tensor, tuple, list)):
            continue  # a size of the positions (sym_size and its arithmetic), not a position
        if packet in _ANGLES:
            found.append(node)
        elif packet in _CARRY or node.target is operator.getitem:
            if packet is aten.mul and all(
                    isinstance(a, fx.Node) and a in seen | {positions} for a in node.args):
                raise MRopeRefused(node, "it multiplies a position by a position")
            todo.extend(node.users)
        else:
            raise MRopeRefused(node, (
                f"the mRoPE positions reach {packet} before any rotary angle (cos/sin); "
                "flat_mrope understands positions only as angles (positions * inv_freq -> "
                "cos/sin), since the verifier fills them as context + j + delta per row. Compute "
                "anything else from the positions outside the verify forward"))
    if not found:
        raise MRopeRefused(positions, "the mRoPE positions never become a rotary angle")
    return found


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("flat_mrope", changed=0)
    positions = find_input(gm, "positions")
    if positions is None or positions.meta["val"].dim() != 3:
        return gm, result  # text rotary: positions [bs, T] are flat-native already
    angles = _angles(positions)
    gm = copy_module(gm)
    old = find_input(gm, "positions")
    sections = old.meta["val"].shape[0]
    index = ctx.inputs.index(old.meta["dspark_input"])
    spec = InputSpec("mrope_positions", "mrope_positions")
    with gm.graph.inserting_before(old):
        new = gm.graph.placeholder("mrope_positions")
    bs, t = old.meta["val"].shape[1:]
    with detect_fake_mode([old.meta["val"]]):
        new.meta["val"] = torch.empty(sections, bs * t, dtype=old.meta["val"].dtype,
                                      device=old.meta["val"].device)
    new.meta["dspark_input"] = spec
    ids = find_input(gm, "input_ids")
    tracer = GraphAppendingTracer(gm.graph)
    first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first_op):
        ids_p = fx.Proxy(ids, tracer)
        dense = fx.Proxy(new, tracer).view(sections, ids_p.size(0), ids_p.size(1))
    old.replace_all_uses_with(dense.node)
    gm.graph.erase_node(old)
    ctx.inputs[index] = spec
    gm.recompile()
    new_gm = retrace(interpret(gm), placeholder_values(gm), list(ctx.inputs))
    _ensure(new_gm)
    result.changed = 1
    result.details = {"sections": int(sections), "rotary angles": len(angles)}
    result.rewrites.append((f"positions [{sections}, bs, T] -> mrope_positions "
                            f"[{sections}, N]", source_line(angles[0])))
    return new_gm, result


def _ensure(gm: fx.GraphModule) -> None:
    if find_input(gm, "positions") is not None:
        raise EnsureError("flat_mrope: the dense positions input is still in the graph")
    node = find_input(gm, "mrope_positions")
    if node is None or node.meta["val"].dim() != 2:
        raise EnsureError("flat_mrope: no mrope_positions [3, bs*T] input after the rewrite")
