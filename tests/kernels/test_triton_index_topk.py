"""The GPU indexer (``kernels/index_topk.py``: Triton scores, then ``torch.topk``) against
``dspark::index_topk``'s reference, under the interpreter on the CPU (as is on a GPU): ragged
steps with an empty request and a padding row, queries that see fewer entries than ``topk``
and more, entries past one score block, over NaN-poisoned entry pages. Random scores do not
tie, so the picks are the reference's (as sets; rows are compared sorted)."""

from __future__ import annotations

import pytest
import torch

from dspark_compile.kernels.index_topk import index_topk_triton
from dspark_compile.ops import compressed_reference as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, PAGES = 4, 48


@pytest.mark.parametrize("chunk", [None, 16, 7], ids=["one_buffer", "chunks16", "chunks7"])
@pytest.mark.parametrize("rate, topk, heads, dim", [(2, 3, 8, 16), (4, 5, 4, 32),
                                                     (2, 40, 2, 16)],
                         ids=["csa", "rate4", "topk_past_every_count"])
def test_triton_index_topk_matches_reference(rate, topk, heads, dim, chunk):
    """``chunk``: the entries scored at a time (the 48 pages of 4 hold 96 / 48 entries), each
    chunk's top keys merged by one more top-k; 7 does not divide the entries or the score
    block."""
    gen = torch.Generator().manual_seed(rate + topk)
    lens, ctx = [4, 0, 3], [37, 5, 0]
    pool = torch.full((PAGES, PAGE, dim), float("nan"))
    table = torch.randperm(PAGES, generator=gen)[:36].view(3, 12).int()
    for i in range(3):
        w = torch.arange((ctx[i] + lens[i]) // rate)
        pool.view(-1, dim)[table[i].long()[w // PAGE] * PAGE + w % PAGE] = torch.randn(
            w.numel(), dim, generator=gen)
    n = sum(lens)
    q = torch.randn(n + 1, heads, dim, generator=gen)
    weights = torch.randn(n + 1, heads, generator=gen)
    fresh = torch.zeros(n + 1, dim)
    qsl = torch.tensor([0, 4, 4, 7], dtype=torch.int32)
    seq = torch.tensor([c + m for c, m in zip(ctx, lens)], dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, weights, pool, fresh, qsl, seq, table)]
    want = reference.index_topk(*args, rate, topk, 0.25)
    got = index_topk_triton(*args, rate, topk, 0.25, entry_chunk=chunk)
    assert got.shape == want.shape == (n + 1, topk) and got.dtype == torch.int64
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
    assert torch.equal(got[-1], torch.full_like(got[-1], -1))
