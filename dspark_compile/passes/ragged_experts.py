"""ragged_experts: mixture-of-experts routing learns which rows are real.

The experts ops are flat-native (``ops/experts.py``: token rows in, token rows out), so the
capture's graph already runs on any ragged split; what the dense graph cannot say is which rows
are padding (a tier pads ``N`` up to its token count). Matches::

    %route = dspark.experts_route.default(%ids, None, 4)               # ids [bs*T, K]

Writes::

    %route = dspark.experts_route.default(%ids, %query_start_loc, 4)

so rows at or past ``query_start_loc[R]`` route nowhere: no expert weights are read for them,
their intermediate rows are zeros and their outputs zero. On a uniform layout every row is
real and the graph computes what the dense one did. ``query_start_loc`` is reused (or added).
The pass ensures that every routing call takes the layout's ``query_start_loc``.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph_inputs import query_start_loc
from .base import EnsureError, PassContext, PassResult, is_op, source_line

__all__ = ["run"]

ROUTE = torch.ops.dspark.experts_route


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("ragged_experts", changed=0)
    routes = [n for n in gm.graph.nodes if is_op(n, ROUTE)]
    if not routes:
        return result
    qsl = query_start_loc(gm, ctx)
    for node in routes:
        ids, bound, num_experts = node.args
        if bound is None:
            node.args = (ids, qsl, num_experts)
            result.changed += 1
            result.rewrites.append((f"{node.name} -> rows past query_start_loc route nowhere",
                                    source_line(node)))
    loose = [n.name for n in routes if n.args[1] is not qsl]
    if loose:
        raise EnsureError(f"ragged_experts: routing calls {loose} do not take the layout's "
                          "query_start_loc")
    gm.recompile()
    result.details["routing calls"] = len(routes)
    return result
