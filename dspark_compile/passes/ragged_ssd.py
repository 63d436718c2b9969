"""ragged_ssd: dense Mamba-2 scan -> ``dspark::ssd`` on packed rows.

Matches (dense verify graph, every request ``T`` tokens; HF's ``mamba2_chunk_scan``)::

    %o = dspark.dense_ssd.default(%x, %dt, %A, %B, %C, %D, %dt_bias, %recurrent_state_0,
                                  %slots, True, 0.0, inf)
        # x [bs, T, H, P], dt [bs, T, H], B, C [bs, T, G, N] -> o [bs, T, H, P] float32

Writes (aten nodes with their fake values, so the graph is not re-traced)::

    %x_rows = reshape(%x, [bs*T, H, P])           # same for dt [bs*T, H], B, C [bs*T, G, N]
    %o_rows = dspark.ssd.default(%x_rows, %dt_rows, %A, %B_rows, %C_rows, %D, %dt_bias,
                  %recurrent_state_0, %query_start_loc, %slots, %ssd_ring_x_0, %ssd_ring_b_0,
                  %ssd_ring_da_0, True, 0.0, inf)                     # [bs*T, H, P]
    %o = view(%o_rows, [bs, T, H, P])

The three replay rings (float32 ``[rows, H, P]``, ``[rows, G, N]``, ``[rows, H]``) become graph
inputs named after the layer's pool. The pass ensures that no dense scan is left and that every
rewrite produced one ragged op.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .base import PassContext, PassResult, check_rewritten, is_op, source_line
from ..graph_inputs import RING_SAMPLE_ROWS, add_input, query_start_loc
from .ragged_conv import layer_index
from .retrace import add_node, finish, replace, reshape_node, start_rewrite

__all__ = ["run"]

DENSE = torch.ops.dspark.dense_ssd
RAGGED = torch.ops.dspark.ssd


def _rings(gm: fx.GraphModule, ctx: PassContext, x: fx.Node, b: fx.Node,
           pool: fx.Node) -> list[fx.Node]:
    """Add ``ssd_ring_{x,b,da}_<i>`` inputs shaped after this call's x and B."""
    _, _, h, p = x.meta["val"].shape
    _, _, g, n_state = b.meta["val"].shape
    rows, index = RING_SAMPLE_ROWS, layer_index(pool)
    shapes = {"x": (rows, h, p), "b": (rows, g, n_state), "da": (rows, h)}
    return [add_input(gm, ctx, f"ssd_ring_{r}", f"ssd_ring_{r}_{index}", shape, torch.float32)
            for r, shape in shapes.items()]


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("ragged_ssd", changed=0)
    if not any(is_op(n, DENSE) for n in gm.graph.nodes):
        return gm, result
    gm, matches, (bs, t, n) = start_rewrite(gm, DENSE)
    qsl = query_start_loc(gm, ctx)
    graph = gm.graph
    exact = True  # every fake value after the replacements so far is current (retrace.py)
    for node in matches:
        x, dt, a, b, c, d, dt_bias, pool, slots, softplus, dt_min, dt_max = node.args
        rings = _rings(gm, ctx, x, b, pool)
        with graph.inserting_before(node):
            x_r, dt_r, b_r, c_r = [
                reshape_node(graph, node, arg, [n, *arg.meta["val"].shape[2:]], decide=exact)
                for arg in (x, dt, b, c)]
            out = add_node(graph, node, RAGGED.default, x_r, dt_r, a, b_r, c_r, d, dt_bias,
                           pool, qsl, slots, *rings, softplus, dt_min, dt_max)
            dense_out = add_node(graph, node, torch.ops.aten.view.default, out,
                                 [bs, t, *x.meta["val"].shape[2:]])
        exact = replace(node, dense_out, exact)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> ssd", source_line(node)))
    gm = finish(gm, exact, ctx.inputs)
    check_rewritten(gm, DENSE, RAGGED, result)
    return gm, result
