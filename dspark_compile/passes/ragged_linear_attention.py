"""ragged_linear_attention: dense gated delta rule -> ``dspark::gated_delta_rule`` on rows.

Matches (dense verify graph, every request ``T`` tokens; HF's GDN recurrence)::

    %o = dspark.dense_gated_delta_rule.default(%q, %k, %v, %g, %beta, %recurrent_state_0,
                                               %slots, 0.25, True)
        # q, k [bs, T, Hk, K], v [bs, T, Hv, V], g [bs, T, Hv] (or [bs, T, Hv, K]: one gate a
        # key channel), beta [bs, T, Hv] -> o [bs, T, Hv, V]

Writes (aten nodes with their fake values, so the graph is not re-traced)::

    %q_rows = reshape(%q, [bs*T, Hk, K])          # same for k, v [bs*T, Hv, V], g, beta
    %o_rows = dspark.gated_delta_rule.default(%q_rows, %k_rows, %v_rows, %g_rows, %beta_rows,
                  %recurrent_state_0, %query_start_loc, %slots, %gdn_ring_k_0, %gdn_ring_v_0,
                  %gdn_ring_g_0, %gdn_ring_beta_0, 0.25, True)     # [bs*T, Hv, V]
    %o = view(%o_rows, [bs, T, Hv, V])

The four replay rings (float32 ``[rows, Hk, K]``, ``[rows, Hv, V]``, g's row shape,
``[rows, Hv]``) become graph inputs, sized by the key heads the rule actually receives (HF
5.17 repeats them to ``Hv`` before the call, 5.24 does not). The pass ensures that no dense
rule is left and that every rewrite produced one ragged op.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .base import PassContext, PassResult, check_rewritten, is_op, source_line
from ..graph_inputs import RING_SAMPLE_ROWS, add_input, query_start_loc
from .ragged_conv import layer_index
from .retrace import add_node, finish, replace, reshape_node, start_rewrite

__all__ = ["run"]

DENSE = torch.ops.dspark.dense_gated_delta_rule
RAGGED = torch.ops.dspark.gated_delta_rule
RINGS = ("k", "v", "g", "beta")


def _rings(gm: fx.GraphModule, ctx: PassContext, k: fx.Node, v: fx.Node, g: fx.Node,
           pool: fx.Node) -> list[fx.Node]:
    """Add ``gdn_ring_{k,v,g,beta}_<i>`` inputs shaped after this call's k, v and g."""
    _, _, hk, kd = k.meta["val"].shape
    _, _, hv, vd = v.meta["val"].shape
    rows = RING_SAMPLE_ROWS
    shapes = {"k": (rows, hk, kd), "v": (rows, hv, vd),
              "g": (rows, *g.meta["val"].shape[2:]), "beta": (rows, hv)}
    index = layer_index(pool)
    return [add_input(gm, ctx, f"gdn_ring_{r}", f"gdn_ring_{r}_{index}", shapes[r],
                      torch.float32) for r in RINGS]


def run(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, PassResult]:
    result = PassResult("ragged_linear_attention", changed=0)
    if not any(is_op(n, DENSE) for n in gm.graph.nodes):
        return gm, result
    gm, matches, (bs, t, n) = start_rewrite(gm, DENSE)
    qsl = query_start_loc(gm, ctx)
    graph, aten = gm.graph, torch.ops.aten
    exact = True  # every fake value after the replacements so far is current (retrace.py)
    for node in matches:
        q, k, v, g, beta, pool, slots, scale, use_l2 = node.args
        rings = _rings(gm, ctx, k, v, g, pool)
        with graph.inserting_before(node):
            rows = [reshape_node(graph, node, a, [n, *a.meta["val"].shape[2:]], decide=exact)
                    for a in (q, k, v, g, beta)]
            out = add_node(graph, node, RAGGED.default, *rows, pool, qsl, slots, *rings, scale,
                           use_l2)
            dense_out = add_node(graph, node, aten.view.default, out,
                                 [bs, t, *v.meta["val"].shape[2:]])
        exact = replace(node, dense_out, exact)
        result.changed += 1
        result.rewrites.append((f"{node.name} -> gated_delta_rule", source_line(node)))
    gm = finish(gm, exact, ctx.inputs)
    check_rewritten(gm, DENSE, RAGGED, result)
    return gm, result
