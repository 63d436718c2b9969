"""ragged_conv: dense causal conv1d -> ``dspark::causal_conv1d`` on packed rows.

Matches (dense verify graph, every request ``T`` tokens; HF's GDN conv over ``[bs, dim, T]``)::

    %o = dspark.dense_causal_conv1d.default(%x, %w, None, %conv_state_0, %slots, 'silu')
        # x [bs, dim, T] -> o [bs, dim, T]

Writes::

    %x_rows = reshape(transpose(%x, 1, 2), [bs*T, dim])
    %o_rows = dspark.causal_conv1d.default(%x_rows, %w, None, %conv_state_0,
                  %query_start_loc, %slots, %conv_ring_0, 'silu')      # [bs*T, dim]
    %o = transpose(view(%o_rows, [bs, T, dim]), 1, 2)

``conv_ring_<i>`` (``[rows, dim]`` in x's dtype, one saved input row per packed token) becomes a
graph input; ``query_start_loc`` is reused (or added). On a uniform layout the rewritten graph
computes what the dense one did; ``flatten_tokens`` then lets the rows be any ragged split.
The pass ensures that no dense conv is left and that every rewrite produced one ragged op.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.proxy import GraphAppendingTracer

from .base import PassContext, PassResult, check_rewritten, is_op, source_line
from .graph_inputs import RING_SAMPLE_ROWS, add_input, find_input, query_start_loc
from .retrace import copy_module, interpret, placeholder_values, retrace

__all__ = ["run", "layer_index"]

DENSE = torch.ops.dspark.dense_causal_conv1d
RAGGED = torch.ops.dspark.causal_conv1d


def layer_index(pool: fx.Node) -> int:
    """Linear-layer index of a state-pool placeholder (``conv_state_3`` -> 3)."""
    return int(pool.meta["dspark_input"].name.rsplit("_", 1)[1])


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("ragged_conv", changed=0)
    if not any(is_op(n, DENSE) for n in gm.graph.nodes):
        return gm, result
    gm = copy_module(gm)
    qsl = query_start_loc(gm, ctx)
    ids = find_input(gm, "input_ids")
    tracer = GraphAppendingTracer(gm.graph)
    for node in [n for n in gm.graph.nodes if is_op(n, DENSE)]:
        x, weight, bias, pool, slots, activation = node.args
        dim = x.meta["val"].shape[1]
        ring = add_input(gm, ctx, "conv_ring", f"conv_ring_{layer_index(pool)}",
                         (RING_SAMPLE_ROWS, dim), x.meta["val"].dtype)
        with gm.graph.inserting_before(node):
            ids_p = fx.Proxy(ids, tracer)
            bs, t = ids_p.size(0), ids_p.size(1)
            rows = fx.Proxy(x, tracer).transpose(1, 2).reshape(bs * t, dim)
            out = gm.graph.call_function(RAGGED.default, (
                rows.node, weight, bias, pool, qsl, slots, ring, activation))
            dense_out = fx.Proxy(out, tracer).view(bs, t, dim).transpose(1, 2)
        node.replace_all_uses_with(dense_out.node)
        gm.graph.erase_node(node)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> causal_conv1d", source_line(node)))
    gm.recompile()
    new_gm = retrace(interpret(gm), placeholder_values(gm), list(ctx.inputs))
    check_rewritten(new_gm, DENSE, RAGGED, result)
    return new_gm, result
