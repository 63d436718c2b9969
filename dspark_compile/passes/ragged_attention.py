"""ragged_attention: dense cached attention -> ``dspark::ragged_attention`` over the paged pool.

Matches (dense verify graph, every request ``T`` tokens)::

    %o = dspark.dense_cached_attention.default(%q, %k, %v, %k_cache_0, %v_cache_0,
                                               %block_table, %context_lens, 0.25)
        # q [bs, H, T, D], k/v [bs, Hkv, T, D] -> o [bs, T, H, D]

Writes (aten nodes with their fake values, so the graph is not re-traced)::

    %q_rows = reshape(transpose(%q, 1, 2), [bs*T, H, D])         # same for k, v
    %o_rows = dspark.ragged_attention.default(%q_rows, %k_rows, %v_rows, %k_cache_0,
                  %v_cache_0, %query_start_loc, %seq_lens, %block_table, %slot_mapping, 0.25)
    %o = view(%o_rows, [bs, T, H, D])

``query_start_loc``, ``seq_lens`` and ``slot_mapping`` become graph inputs and
``context_lens`` goes away. On a uniform layout (every length ``T``) the rewritten graph
computes exactly what the dense one did, so it can run between passes; ``flatten_tokens``
then lets the rows be any ragged split. Matching is by op packet, so every overload of the
dense op is caught, and the pass ensures that none is left.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from ..graph_inputs import InputKind, InputSpec
from .base import PassContext, PassResult, check_rewritten, is_op, source_line
from .retrace import add_node, finish, replace, reshape_node, start_rewrite

__all__ = ["run"]

DENSE = torch.ops.dspark.dense_cached_attention
RAGGED = torch.ops.dspark.ragged_attention


def _add_inputs(gm: fx.GraphModule, ctx: PassContext) -> dict[str, fx.Node]:
    """Append the ragged metadata placeholders (with symbolic fake values)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ids = next(n for n in placeholders if n.meta["dspark_input"].kind == InputKind.INPUT_IDS)
    bs, t = ids.meta["val"].shape
    mode = detect_fake_mode([ids.meta["val"]])
    with mode:
        vals = {
            "query_start_loc": torch.empty(bs + 1, dtype=torch.int32),
            "seq_lens": torch.empty(bs, dtype=torch.int32),
            "slot_mapping": torch.empty(bs * t, dtype=torch.int64),
        }
    new = {}
    with gm.graph.inserting_after(placeholders[-1]):
        for name in reversed(vals):  # inserting_after: reverse keeps the declared order
            node = gm.graph.placeholder(name)
            node.meta["val"] = vals[name]
            node.meta["dspark_input"] = InputSpec(name, name)
            new[name] = node
    ctx.inputs.extend(new[name].meta["dspark_input"] for name in vals)
    return new


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("ragged_attention", changed=0)
    if not any(is_op(n, DENSE) for n in gm.graph.nodes):
        # a model without attention layers (all linear attention) reads no context lengths
        _drop_unused_input(gm, ctx, next(i for i, s in enumerate(ctx.inputs)
                                         if s.kind == InputKind.CONTEXT_LENS))
        return gm, result
    # a copy: the dense graph stays intact for Verifier.run_dense
    gm, matches, (bs, t, rows) = start_rewrite(gm, DENSE)
    meta = _add_inputs(gm, ctx)
    graph, aten = gm.graph, torch.ops.aten
    exact = True  # every fake value after the replacements so far is current (retrace.py)
    for node in matches:
        q, k, v, k_cache, v_cache, block_table, _context_lens, scale, *semantics = node.args
        if node.kwargs:  # window / softcap / sinks, however the capture recorded them
            names = ("window", "softcap", "sinks")[len(semantics):]
            semantics += [node.kwargs[n] for n in names if n in node.kwargs]
        _, heads, _, dim = q.meta["val"].shape
        kv_heads, v_dim = k.meta["val"].shape[1], v.meta["val"].shape[-1]
        with graph.inserting_before(node):
            def to_rows(x: fx.Node, n_heads: int, d: int) -> fx.Node:
                x_t = add_node(graph, node, aten.transpose.int, x, 1, 2)  # [bs, T, h, d]
                return reshape_node(graph, node, x_t, [rows, n_heads, d], decide=exact)

            out = add_node(graph, node, RAGGED.default, to_rows(q, heads, dim),
                           to_rows(k, kv_heads, dim), to_rows(v, kv_heads, v_dim), k_cache,
                           v_cache, meta["query_start_loc"], meta["seq_lens"], block_table,
                           meta["slot_mapping"], scale, *semantics)
            dense_out = add_node(graph, node, aten.view.default, out, [bs, t, heads, v_dim])
        exact = replace(node, dense_out, exact)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> ragged_attention", source_line(node)))
    ctx_idx = next(i for i, s in enumerate(ctx.inputs) if s.kind == InputKind.CONTEXT_LENS)
    gm = finish(gm, exact, ctx.inputs)  # DCE: the dense attention's inputs (its mask) go
    _drop_unused_input(gm, ctx, ctx_idx)
    check_rewritten(gm, DENSE, RAGGED, result)
    return gm, result


def _drop_unused_input(gm: fx.GraphModule, ctx: PassContext, index: int) -> None:
    node = [n for n in gm.graph.nodes if n.op == "placeholder"][index]
    if not node.users:
        gm.graph.erase_node(node)
        del ctx.inputs[index]
        gm.recompile()
