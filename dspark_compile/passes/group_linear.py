"""group_linears: matmuls by weights that read the same rows become one ``dspark::linear_group``.

Matches (packed graph; the views are of one tensor, e.g. q, k and v of a layer)::

    %t   = aten.t.default(%q_proj_weight)
    %view = aten.view.default(%x, [N, K])
    %mm  = aten.mm.default(%view, %t)
    ... the same for %k_proj_weight, %v_proj_weight
      ->
    %g   = dspark.linear_group.default(%view, [%q_proj_weight, %k_proj_weight, %v_proj_weight])
    %mm  = getitem(%g, 0)  ...

Semantics-preserving: the reference op is ``torch.mm`` per weight, so every graph runs it (the
CPU tests cover the rewrite); the Triton lowering of the op streams a group's weights in one
launch at small ``N`` (``kernels/linear.py``). Only weights that are graph inputs of
kind ``param`` (read through ``aten.t``) are grouped, at most ``MAX_GROUP`` per op, in graph
order; a lone weight stays an ``aten.mm`` (the vendor GEMM was faster for every single weight
of the 1.1B benchmark model at M = 3..64 on an H200: ``python benchmarks/linear_kernel.py``; figures in docs/tuning.md).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import PassResult, source_line
from ..kernels.linear import MAX_GROUP

__all__ = ["group_linears", "row_source"]

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.reshape.default)


def _weight(node: fx.Node, params: set) -> fx.Node | None:
    """The parameter placeholder ``node`` transposes, if it is ``aten.t(param)``."""
    if node.op == "call_function" and node.target is torch.ops.aten.t.default:
        w = node.args[0]
        if isinstance(w, fx.Node) and w in params and w.meta["val"].dim() == 2:
            return w
    return None


def row_source(node: fx.Node) -> fx.Node:
    """The tensor under any chain of views (matmuls of one row source share their input)."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def group_linears(gm: fx.GraphModule) -> PassResult:
    """Rewrite ``gm`` in place (see the module docstring)."""
    result = PassResult("group_linears", changed=0)
    params = {n for n in gm.graph.find_nodes(op="placeholder")
              if getattr(n.meta.get("dspark_input"), "kind", None) == "param"}
    groups: dict[tuple, list[tuple[fx.Node, fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.mm.default:
            continue
        x, t = node.args
        w = _weight(t, params)
        if w is None or x.meta["val"].dtype != w.meta["val"].dtype:
            continue
        key = (row_source(x), tuple(str(s) for s in x.meta["val"].shape))
        groups.setdefault(key, []).append((node, w))
    for members in groups.values():
        for i in range(0, len(members), MAX_GROUP):
            chunk = members[i:i + MAX_GROUP]
            if len(chunk) < 2:
                continue
            first = chunk[0][0]
            with gm.graph.inserting_before(first):
                group = gm.graph.call_function(torch.ops.dspark.linear_group.default,
                                               (first.args[0], [w for _, w in chunk]))
                group.meta["val"] = [mm.meta["val"] for mm, _ in chunk]
            where = source_line(first)
            for j, (mm, _) in enumerate(chunk):
                with gm.graph.inserting_before(mm):
                    item = gm.graph.call_function(operator.getitem, (group, j))
                item.meta["val"] = mm.meta["val"]
                mm.replace_all_uses_with(item)
                x, t = mm.args
                gm.graph.erase_node(mm)
                for dead in (t, x):  # this mm's transpose and row view, if nothing else reads
                    if not dead.users and dead.op == "call_function":
                        gm.graph.erase_node(dead)
            result.changed += 1
            result.rewrites.append((" + ".join(w.name for _, w in chunk) + " -> linear_group",
                                    where))
    result.details = {"groups": result.changed}
    gm.recompile()
    return result
