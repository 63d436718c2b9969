"""``outer_products``: a matmul over a contraction of length one is a broadcast multiply, value
for value (one product, rounded once, either way)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_compile.passes.outer_product import outer_products

aten = torch.ops.aten


def _angles(inv, pos, x, w, bi, bp):
    return torch.mm(inv, pos).cos(), torch.mm(x, w), torch.bmm(bi, bp)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.rand(64, 1, generator=g), torch.arange(7.0).view(1, 7) * 997.0,
            torch.randn(5, 2, generator=g), torch.randn(2, 7, generator=g),
            torch.randn(3, 4, 1, generator=g), torch.randn(3, 1, 6, generator=g))


def test_matmuls_over_one_become_multiplies_with_the_same_values() -> None:
    args = _inputs()
    gm = make_fx(_angles, tracing_mode="fake")(*args)
    want = gm(*args)
    result = outer_products(gm)
    assert result.changed == 2  # the K=1 mm and bmm; the K=2 mm stays
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.mm.default) == 1 and aten.bmm.default not in targets
    for a, b in zip(want, gm(*args)):
        assert torch.equal(a, b)
