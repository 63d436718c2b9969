"""The Triton compressor step (``kernels/compress.py``) against ``dspark::compress``'s reference,
under the interpreter on the CPU (as is on a GPU): HCA and CSA windows, rates that are not a
power of two, more slots than one slot block, ragged steps with an empty request and padding
rows over NaN-poisoned entry pools; float32 within rounding (the kernel divides once by the
softmax's sum where the reference multiplies by its weights), bf16 within a few bf16 ulps (the
reference rounds the softmax weights, products and sums to bf16 as HF does; the kernel
accumulates in float32). The raw pools are bitwise the same (a copy). The rows come in as
row-strided slices of one tensor, as a fused projection's output does."""

from __future__ import annotations

import pytest
import torch

from dspark_compile.kernels.compress import compress_triton
from dspark_compile.ops import compressed_reference as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, PAGES = 4, 48
STEPS = ([7, 0, 5], [3, 4, 1], [5, 2, 6])


@pytest.mark.parametrize("overlap, rate, dim, rope_pairs", [
    (False, 4, 32, 4), (True, 2, 32, 4), (True, 4, 16, 2), (False, 3, 24, 4),
    (False, 20, 16, 2)], ids=["hca", "csa", "csa_rate4", "hca_rate3", "hca_two_slot_blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_compress_matches_reference(overlap, rate, dim, rope_pairs, dtype):
    gen = torch.Generator().manual_seed(rate * 7 + dim)
    width = 2 * dim if overlap else dim

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt).to(DEVICE)

    pools = [rand(PAGES, PAGE, width), rand(PAGES, PAGE, width),
             torch.full((PAGES, PAGE, dim), float("nan"), dtype=dtype, device=DEVICE)]
    mine = [p.clone() for p in pools]
    table = torch.randperm(PAGES, generator=gen)[:36].view(3, 12).int().to(DEVICE)
    bias, weight = rand(rate, width, dt=torch.float32), rand(dim, dt=torch.float32)
    inv_freq = (1.0 / 100 ** (torch.arange(rope_pairs) / rope_pairs)).to(DEVICE)
    ctx = [0, 0, 0]
    steps = STEPS if rate != 20 else ([12, 0, 9], [10, 4, 1], [3, 17, 12])  # past a window
    tol = dict(rtol=0, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -5, atol=2 ** -5)
    for lens in steps:
        n = sum(lens)
        both = rand(n + 2, 2 * width)  # row-strided views, as slices of one projection
        kv, gate = both[:, :width], both[:, width:]
        qsl = torch.tensor([0, lens[0], lens[0] + lens[1], n], dtype=torch.int32, device=DEVICE)
        seq = torch.tensor([c + m for c, m in zip(ctx, lens)], dtype=torch.int32, device=DEVICE)
        rows = []
        for i in range(3):
            p = torch.arange(ctx[i], ctx[i] + lens[i], device=DEVICE)
            rows.append(table[i].long()[p // PAGE] * PAGE + p % PAGE)
        slots = torch.cat(rows + [torch.full((2,), -1, device=DEVICE)])
        args = (qsl, seq, table, slots, bias, weight, inv_freq, rate, overlap, 1e-6, 1.25)
        want = reference.compress(kv, gate, *pools, *args)
        got = compress_triton(kv, gate, *mine, *args)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert torch.equal(got[-2:], torch.zeros_like(got[-2:]))  # padding rows
        assert torch.equal(mine[0], pools[0]) and torch.equal(mine[1], pools[1])
        torch.testing.assert_close(mine[2].float(), pools[2].float(), equal_nan=True, **tol)
        ctx = [c + m for c, m in zip(ctx, lens)]


def test_triton_compress_refuses_by_name():
    kv = torch.zeros(4, 32)
    pools = [torch.zeros(8, 4, 32), torch.zeros(8, 4, 32), torch.zeros(8, 4, 32)]
    meta = (torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"position_bias is \(3, 32\)"):
        compress_triton(kv, kv, *pools, *meta, torch.zeros(3, 32), torch.zeros(32),
                        torch.zeros(4), 4, False, 1e-6, 1.0)
    with pytest.raises(ValueError, match=r"gate is on cpu with strides \(1, 4\)"):
        compress_triton(kv, kv.t().contiguous().t(), *pools, *meta, torch.zeros(4, 32),
                        torch.zeros(32), torch.zeros(4), 4, False, 1e-6, 1.0)
    with pytest.raises(ValueError, match="kv_pool .*contiguous"):
        compress_triton(kv, kv, pools[0].transpose(0, 1), *pools[1:], *meta,
                        torch.zeros(4, 32), torch.zeros(32), torch.zeros(4), 4, False, 1e-6,
                        1.0)
