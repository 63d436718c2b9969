"""ragged_conv: dense causal conv1d -> ``dspark::causal_conv1d`` on packed rows.

Matches (dense verify graph, every request ``T`` tokens; HF's GDN conv over ``[bs, dim, T]``)::

    %o = dspark.dense_causal_conv1d.default(%x, %w, None, %conv_state_0, %slots, 'silu')
        # x [bs, dim, T] -> o [bs, dim, T]

Writes (aten nodes with their fake values, so the graph is not re-traced)::

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

from .base import PassContext, PassResult, check_rewritten, is_op, source_line
from ..graph_inputs import RING_SAMPLE_ROWS, add_input, query_start_loc
from .retrace import add_node, finish, replace, reshape_node, start_rewrite

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
    gm, matches, (bs, t, n) = start_rewrite(gm, DENSE)
    qsl = query_start_loc(gm, ctx)
    graph, aten = gm.graph, torch.ops.aten
    exact = True  # every fake value after the replacements so far is current (retrace.py)
    for node in matches:
        x, weight, bias, pool, slots, activation = node.args
        dim = x.meta["val"].shape[1]
        ring = add_input(gm, ctx, "conv_ring", f"conv_ring_{layer_index(pool)}",
                         (RING_SAMPLE_ROWS, dim), x.meta["val"].dtype)
        with graph.inserting_before(node):
            x_t = add_node(graph, node, aten.transpose.int, x, 1, 2)
            rows = reshape_node(graph, node, x_t, [n, dim], decide=exact)
            out = add_node(graph, node, RAGGED.default, rows, weight, bias, pool, qsl, slots,
                           ring, activation)
            out_v = add_node(graph, node, aten.view.default, out, [bs, t, dim])
            dense_out = add_node(graph, node, aten.transpose.int, out_v, 1, 2)
        exact = replace(node, dense_out, exact)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> causal_conv1d", source_line(node)))
    gm = finish(gm, exact, ctx.inputs)
    check_rewritten(gm, DENSE, RAGGED, result)
    return gm, result
