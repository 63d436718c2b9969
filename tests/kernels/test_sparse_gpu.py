"""DeepSeek Sparse Attention's kernels on the GPU (``pytest -m gpu``; skipped without one).

Each Triton op of ``kernels/sparse.py`` against its reference at DeepSeek-V3.2's shapes: the
attention as HF's eager MLA path runs it (128 heads, each its own K/V head, Dk 192 = 128 + a
64-channel rotary, Dv 128, 2048 picks a query) and a GQA build with sinks; the indexer of 64
heads x 128 picking 2048. In bf16 and float32, over a ragged step with a prefill-length
request, an empty one and padding rows. Every pool row is random (nothing is NaN here: the
interpreter tests poison pools).
"""

from __future__ import annotations

import pytest
import torch
from helpers import paged_step

pytestmark = pytest.mark.gpu
OPS = torch.ops.dspark
DEV = "cuda"
PAGE, TOPK = 64, 2048
INDEX_HEADS, INDEX_DIM = 64, 128
TOL = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _layout(contexts, lens, max_context, gen, pad_rows=3):
    """Metadata of one ragged step on the device: ``(qsl, seq_lens, block_table,
    slot_mapping, pages)``; padding rows map to -1."""
    per = -(-max_context // PAGE)
    pages = len(lens) * per + 2
    step = paged_step(contexts, lens, PAGE, pages, per, gen, pad_rows)
    return [t.to(DEV) for t in step] + [pages]


def _rnd(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def _picks(gen, contexts, lens, n, num_picks):
    """Each real query: up to ``num_picks`` distinct positions ``<= p`` in random order, then
    -1; a few rows also name positions past the query (ignored)."""
    picks = torch.full((n, num_picks), -1, dtype=torch.int64)
    row = 0
    for c, length in zip(contexts, lens):
        for j in range(length):
            chosen = torch.randperm(c + j + 1, generator=gen)[:num_picks]
            picks[row, :chosen.numel()] = chosen
            if chosen.numel() < num_picks and j % 3 == 1:
                picks[row, -1] = c + j + 1 + j  # past the query
            row += 1
    return picks.to(DEV)


# (H, Hkv, Dk, Dv, sinks): HF's eager MLA (heads expanded) and a GQA build with sinks
SHAPES = {"mla": (128, 128, 192, 128, False), "gqa_sinks": (32, 4, 128, 128, True)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_sparse_attention_matches_reference(shape, dtype):
    from dspark_compile.kernels.sparse import sparse_attention_triton

    heads, hkv, dk, dv, with_sinks = SHAPES[shape]
    gen = torch.Generator().manual_seed(3)
    contexts, lens = [0, 300, 2100, 5, 40], [200, 3, 1, 0, 8]
    qsl, seq_lens, table, slots, pages = _layout(contexts, lens, 2304, gen)
    n = slots.shape[0]
    q = _rnd(gen, n, heads, dk, dtype=dtype)
    k = _rnd(gen, n, hkv, dk, dtype=dtype)
    v = _rnd(gen, n, hkv, dv, dtype=dtype)
    pools = [_rnd(gen, pages, PAGE, hkv, dk, dtype=dtype),
             _rnd(gen, pages, PAGE, hkv, dv, dtype=dtype)]
    sinks = _rnd(gen, heads, dtype=torch.float32) if with_sinks else None
    picks = _picks(gen, contexts, lens, n, TOPK)
    got_pools, ref_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    rest = (qsl, seq_lens, table, slots, dk ** -0.5, picks)
    got = sparse_attention_triton(q, k, v, *got_pools, *rest, sinks)
    want = OPS.sparse_attention(q, k, v, *ref_pools, *rest, sinks)
    torch.testing.assert_close(got, want, **TOL[dtype])
    real = int(qsl[-1])
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    for a, b in zip(got_pools, ref_pools):
        assert torch.equal(a, b)


def _index_scores(q, weights, keys, scale):
    """float64 scores ``[L, S]`` of one request's queries over its keys."""
    dots = torch.einsum("lhd,sd->lhs", q.double(), keys.double()).relu() * scale
    return (dots * weights.double()[:, :, None]).sum(1)


@pytest.mark.parametrize("chunk", [None, 1000], ids=["one_buffer", "chunks1000"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_sparse_index_matches_reference_up_to_near_ties(dtype, chunk, monkeypatch):
    """Each row picks as many keys as the reference, and the sorted scores of its picks equal
    the reference's picks' (a pick may differ only between equal or nearly equal scores); the
    key pool after the call is the reference's. ``chunk``: positions scored at a time, each
    chunk's top 2048 merged (the 4096-position slots take 5)."""
    from dspark_compile.kernels import index_topk
    from dspark_compile.kernels.sparse import sparse_index_triton
    from dspark_compile.ops.attention_reference import _gather_keys

    if chunk is not None:
        monkeypatch.setattr(index_topk, "ENTRY_CHUNK", chunk)

    gen = torch.Generator().manual_seed(4)
    scale = INDEX_DIM ** -0.5
    contexts, lens = [2100, 3000, 40, 0, 7], [4, 8, 1, 0, 300]
    qsl, seq_lens, table, slots, pages = _layout(contexts, lens, 4096, gen)
    n = slots.shape[0]
    q = _rnd(gen, n, INDEX_HEADS, INDEX_DIM, dtype=dtype)
    weights = _rnd(gen, n, INDEX_HEADS, dtype=torch.float32, scale=0.1)
    k = _rnd(gen, n, INDEX_DIM, dtype=dtype)
    pool = _rnd(gen, pages, PAGE, INDEX_DIM, dtype=dtype)
    got_pool, ref_pool = pool.clone(), pool.clone()
    rest = (qsl, seq_lens, table, slots, TOPK, scale)
    got = sparse_index_triton(q, weights, k, got_pool, *rest)
    want = OPS.sparse_index(q, weights, k, ref_pool, *rest)
    assert torch.equal(got_pool, ref_pool)
    assert got.shape == want.shape == (n, TOPK)
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    starts = qsl.tolist()
    for i, c in enumerate(contexts):
        rows = slice(starts[i], starts[i + 1])
        if not lens[i]:
            continue
        keys = _gather_keys(ref_pool, table[i], 0, c + lens[i])
        scores = _index_scores(q[rows], weights[rows], keys, scale)
        for j in range(lens[i]):
            g, w = got[rows][j], want[rows][j]
            assert (g <= c + j).all() and (w <= c + j).all()
            a = scores[j, g[g >= 0]].sort().values
            b = scores[j, w[w >= 0]].sort().values
            torch.testing.assert_close(a, b, atol=1e-4 * scores[j].abs().max().item(), rtol=0)
    assert (got[starts[-1]:] == -1).all(), "padding rows pick nothing"


# MiniMax-M3's block-sparse layers: 64 query heads, 4 KV heads and 4 indexer heads of 128, 16
# blocks of 128 keys kept per indexer head, the query's own block always
M3_HEADS, M3_KV, M3_DIM, M3_BLOCK, M3_TOPK = 64, 4, 128, 128, 16


def _block_picks(gen, contexts, lens, n, rows):
    """Each real query and pick row: up to ``M3_TOPK`` distinct blocks ``<=`` its own (its
    own first), then -1."""
    picks = torch.full((n, rows, M3_TOPK), -1, dtype=torch.int64)
    row = 0
    for c, length in zip(contexts, lens):
        for j in range(length):
            own = (c + j) // M3_BLOCK
            for r in range(rows):
                rest = torch.randperm(own, generator=gen)[:M3_TOPK - 1] if own else \
                    torch.zeros(0, dtype=torch.int64)
                chosen = torch.cat([torch.tensor([own]), rest])
                picks[row, r, :chosen.numel()] = chosen
            row += 1
    return picks.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_block_sparse_attention_matches_reference(dtype):
    from dspark_compile.kernels.sparse import sparse_attention_triton

    gen = torch.Generator().manual_seed(5)
    contexts, lens = [0, 300, 2100, 5, 40], [200, 3, 1, 0, 8]
    qsl, seq_lens, table, slots, pages = _layout(contexts, lens, 2304, gen)
    n = slots.shape[0]
    q = _rnd(gen, n, M3_HEADS, M3_DIM, dtype=dtype)
    k, v = (_rnd(gen, n, M3_KV, M3_DIM, dtype=dtype) for _ in range(2))
    pools = [_rnd(gen, pages, PAGE, M3_KV, M3_DIM, dtype=dtype) for _ in range(2)]
    picks = _block_picks(gen, contexts, lens, n, M3_KV)
    got_pools, ref_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    rest = (qsl, seq_lens, table, slots, M3_DIM ** -0.5, picks, None, M3_BLOCK)
    got = sparse_attention_triton(q, k, v, *got_pools, *rest)
    want = OPS.sparse_attention(q, k, v, *ref_pools, *rest)
    torch.testing.assert_close(got, want, **TOL[dtype])
    real = int(qsl[-1])
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    for a, b in zip(got_pools, ref_pools):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_block_index_matches_reference_up_to_near_ties(dtype):
    """Each row and head picks as many blocks as the reference, and the sorted block maxima of
    its picks equal the reference's picks' (a pick may differ only between nearly equal
    maxima); the key pool after the call is the reference's."""
    from dspark_compile.kernels.sparse import block_index_triton
    from dspark_compile.ops.attention_reference import _gather_keys

    gen = torch.Generator().manual_seed(6)
    contexts, lens = [2100, 3000, 40, 0, 7], [4, 8, 1, 0, 300]
    qsl, seq_lens, table, slots, pages = _layout(contexts, lens, 4096, gen)
    n = slots.shape[0]
    q = _rnd(gen, n, M3_KV, M3_DIM, dtype=dtype)
    k = _rnd(gen, n, M3_DIM, dtype=dtype)
    pool = _rnd(gen, pages, PAGE, M3_DIM, dtype=dtype)
    got_pool, ref_pool = pool.clone(), pool.clone()
    rest = (qsl, seq_lens, table, slots, M3_BLOCK, M3_TOPK, 1)
    got = block_index_triton(q, k, got_pool, *rest)
    want = OPS.block_index(q, k, ref_pool, *rest)
    assert torch.equal(got_pool, ref_pool)
    assert got.shape == want.shape == (n, M3_KV, M3_TOPK)
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    starts = qsl.tolist()
    for i, c in enumerate(contexts):
        if not lens[i]:
            continue
        rows = slice(starts[i], starts[i + 1])
        keys = _gather_keys(ref_pool, table[i], 0, c + lens[i]).double()
        dots = torch.einsum("lhd,sd->lhs", q[rows].double(), keys)  # [L, Hi, S]
        for j in range(lens[i]):
            pos = c + j
            maxima = torch.stack([dots[j, :, b * M3_BLOCK:min(pos + 1, (b + 1) * M3_BLOCK)]
                                  .amax(-1) for b in range(pos // M3_BLOCK + 1)], -1)
            maxima[:, -1] = float("inf")  # the local block
            for h in range(M3_KV):
                g, w = got[rows][j, h], want[rows][j, h]
                assert (g <= pos // M3_BLOCK).all() and (g[0] == pos // M3_BLOCK)
                a = maxima[h, g[g >= 0]].sort().values
                b = maxima[h, w[w >= 0]].sort().values
                torch.testing.assert_close(a, b, atol=1e-4 * dots[j, h].abs().max().item(),
                                           rtol=0)
    assert (got[starts[-1]:] == -1).all(), "padding rows pick nothing"
