"""masked_fma: multiply-by-mask causality becomes selects; torch.compile(backend="dspark")."""

import torch
from expecttest import TestCase
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_compile.passes import masked_fma
from dspark_compile.passes.printing import graph_text


def mask_causality(a, b, m):
    """The patterns engines write: a + b * mask, and a * tril(b)."""
    return a + b * m.float(), a * torch.tril(b)


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(5, 5, generator=gen), torch.randn(5, 5, generator=gen)
    return a, b, torch.rand(5, 5, generator=gen) > 0.5


class Snapshot(TestCase):
    def test_rewrite(self):
        gm = make_fx(mask_causality)(*inputs())
        self.assertExpectedInline(graph_text(gm), """\
inputs: a_1[5, 5], b_1[5, 5], m_1[5, 5]
_to_copy = aten._to_copy(m_1, dtype=float32)  # [5, 5]
mul = aten.mul(b_1, _to_copy)  # [5, 5]
add = aten.add(a_1, mul)  # [5, 5]
tril = aten.tril(b_1)  # [5, 5]
mul_1 = aten.mul(a_1, tril)  # [5, 5]
return [add, mul_1]""")
        result = masked_fma.run(gm)
        self.assertEqual(result.changed, 2)
        self.assertExpectedInline(graph_text(gm), """\
inputs: a_1[5, 5], b_1[5, 5], m_1[5, 5]
where_scalar_other = aten.where(m_1, b_1, 0)  # [5, 5]
add = aten.add(a_1, where_scalar_other)  # [5, 5]
mul_tensor = aten.mul(a_1, b_1)  # [5, 5]
tril_default = aten.tril(mul_tensor)  # [5, 5]
return [add, tril_default]""")


def test_same_values_on_finite_inputs_and_nan_contained():
    a, b, m = inputs(1)
    gm = make_fx(mask_causality)(a, b, m)
    masked_fma.run(gm)
    for got, want in zip(gm(a, b, m), mask_causality(a, b, m)):
        assert torch.equal(got, want)
    b_bad = torch.where(m, b, float("nan"))  # NaN only where the mask drops it
    a_bad = torch.where(torch.ones(5, 5, dtype=torch.bool).triu(1), float("inf"), a)
    eager = mask_causality(a_bad, b_bad, m)
    assert not torch.isfinite(eager[0]).all() and not torch.isfinite(eager[1]).all()
    rewritten = gm(a, b_bad, m)[0], gm(a_bad, b, m)[1]
    assert torch.isfinite(rewritten[0]).all() and torch.isfinite(rewritten[1]).all()


class Masked(torch.nn.Module):
    def forward(self, a, b, m):
        return (a + b * m.float()).sum(-1), (a * torch.tril(b)).sum(-1)


def test_torch_compile_backend_matches_eager_and_contains_nan():
    torch._dynamo.reset()
    compiled = torch.compile(Masked(), backend="dspark")  # found through the entry point
    a, b, m = inputs(2)
    for got, want in zip(compiled(a, b, m), Masked()(a, b, m)):
        torch.testing.assert_close(got, want)
    b_bad = torch.where(m, b, float("nan"))
    a_bad = torch.where(torch.ones(5, 5, dtype=torch.bool).triu(1), float("nan"), a)
    assert torch.isfinite(compiled(a, b_bad, m)[0]).all()
    assert torch.isfinite(compiled(a_bad, b, m)[1]).all()
    assert torch.isnan(Masked()(a_bad, b, m)[1]).any()  # eager leaks; the backend does not
