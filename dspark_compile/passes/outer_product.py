"""outer_products: a matmul over a contraction of length one becomes a broadcast multiply.

Matches (packed graph; the rotary angles of HF 5.17's ``inv_freq @ positions``)::

    %f = aten.mm.default(%a, %b)         # a [M, 1], b [1, N]
    %f = aten.bmm.default(%a, %b)        # a [B, M, 1], b [B, 1, N]
      ->
    %f = aten.mul.Tensor(%a, %b)         # broadcast to [M, N] / [B, M, N]

Each output element of such a matmul is one product rounded once, as the multiply's is, so
the values do not change (fp32 without TF32; with TF32 the multiply keeps the full fp32
product the matmul would round its inputs away from). What changes is the launch: the matmul
is a cuBLAS call between two copies that Inductor cannot fuse, and the value behind it
(``cos``/``sin`` of the angles) reads one buffer, so Inductor recomputes it inline instead of
writing it once for every reader (``select._realize_op_inputs``). As a multiply, the angles,
their cos and sin are one Inductor kernel.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .base import PassResult, source_line

__all__ = ["outer_products"]

aten = torch.ops.aten


def _one_contraction(node: fx.Node) -> bool:
    a, b = (x.meta.get("val") for x in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if not (a.dtype.is_floating_point and a.dtype == b.dtype):
        return False
    rank = 2 if node.target is aten.mm.default else 3
    return (a.dim() == rank and b.dim() == rank and a.shape[-1] == 1 and b.shape[-2] == 1
            and (rank == 2 or a.shape[0] == b.shape[0]))


def outer_products(gm: fx.GraphModule) -> PassResult:
    """Rewrite every ``mm`` / ``bmm`` whose contraction has length one (module docstring)."""
    result = PassResult("outer_products", changed=0)
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target in (aten.mm.default, aten.bmm.default)
                and _one_contraction(node)):
            node.target = aten.mul.Tensor
            result.changed += 1
            result.rewrites.append((f"{node.name}: matmul over one -> mul", source_line(node)))
    if result.changed:
        gm.recompile()
    return result
