"""DeepSeek-V4's compressed-layer kernels on the GPU (``pytest -m gpu``; skipped without one).

Each Triton op against its reference at ``transformers.DeepseekV4Config()``'s shapes (head dim
512 with a 64-channel rotary, 64 heads on one K=V head, a 128-token window with sinks, CSA
every 4 tokens with overlap, HCA every 128, an indexer of 64 heads x 128 picking 512), in bf16
and float32, over a ragged step with a prefill-length request, an empty one and padding rows.
Every pool row is random (nothing is NaN here: the interpreter tests poison pools).
"""

from __future__ import annotations

import pytest
import torch
from helpers import paged_step

pytestmark = pytest.mark.gpu
OPS = torch.ops.dspark
D, ROPE, HEADS, WINDOW, PAGE = 512, 64, 64, 128, 64
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 512
TOL = {torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _layout(contexts, lens, max_context, gen, pad_rows=3):
    """Metadata of one ragged step on the GPU: ``(qsl, seq_lens, block_table, slot_mapping,
    pages)``; padding rows map to -1."""
    per = -(-max_context // PAGE)
    pages = len(lens) * per + 2
    step = paged_step(contexts, lens, PAGE, pages, per, gen, pad_rows)
    return [t.cuda() for t in step] + [pages]


def _rnd(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rate,overlap,dim", [(4, True, D), (128, False, D),
                                              (4, True, INDEX_DIM)],
                         ids=["csa", "hca", "indexer"])
def test_compress_matches_reference(rate, overlap, dim, dtype):
    from dspark_compile.kernels.compress import compress_triton

    gen = torch.Generator().manual_seed(rate + dim)
    contexts, lens = [0, 130, 1000, 257, 5], [300, 1, 0, 8, 4]
    qsl, seq_lens, table, slots, pages = _layout(contexts, lens, 1536, gen)
    n, width = slots.shape[0], (2 if overlap else 1) * dim
    kv, gate = _rnd(gen, n, width, dtype=dtype), _rnd(gen, n, width, dtype=dtype)
    pools = [_rnd(gen, pages, PAGE, w, dtype=dtype) for w in (width, width, dim)]
    bias = _rnd(gen, rate, width, dtype=dtype, scale=0.5)
    norm = _rnd(gen, dim, dtype=dtype).abs()
    inv_freq = (1.0 / 160000 ** (torch.arange(0, ROPE, 2) / ROPE)).float().cuda()
    got_pools, ref_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    rest = (qsl, seq_lens, table, slots, bias, norm, inv_freq, rate, overlap, 1e-6, 1.0)
    got = compress_triton(kv, gate, *got_pools, *rest)
    want = OPS.compress(kv, gate, *ref_pools, *rest)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got_pools[0], ref_pools[0]) and torch.equal(got_pools[1], ref_pools[1])
    torch.testing.assert_close(got_pools[2], ref_pools[2], **TOL[dtype])


def _index_scores(q, weights, keys, scale):
    """float64 scores ``[L, E]`` of one request's queries over its entries."""
    dots = torch.einsum("lhd,ed->lhe", q.double(), keys.double()).relu() * scale
    return (dots * weights.double()[:, :, None]).sum(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_index_topk_matches_reference_up_to_near_ties(dtype):
    """Each row picks as many entries as the reference, and the sorted scores of its picks
    equal the reference's picks' (a pick may differ only between equal or nearly equal
    scores: equal ones are ordered by ``torch.topk`` over rows of another length)."""
    from dspark_compile.kernels.index_topk import index_topk_triton
    from dspark_compile.ops.attention_reference import _gather_keys

    gen = torch.Generator().manual_seed(1)
    rate, scale = 4, INDEX_DIM ** -0.5
    contexts, lens = [2100, 3000, 40, 0, 7], [4, 8, 1, 0, 6]
    qsl, seq_lens, table, _, pages = _layout(contexts, lens, 4096, gen)
    n = int(qsl[-1]) + 3
    q = _rnd(gen, n, INDEX_HEADS, INDEX_DIM, dtype=dtype)
    weights = _rnd(gen, n, INDEX_HEADS, dtype=torch.float32, scale=0.1)
    entries = _rnd(gen, pages, PAGE, INDEX_DIM, dtype=dtype)
    fresh = torch.zeros(n, INDEX_DIM, dtype=dtype, device="cuda")
    args = (q, weights, entries, fresh, qsl, seq_lens, table, rate, TOPK, scale)
    got, want = index_topk_triton(*args), OPS.index_topk(*args)
    assert got.shape == want.shape == (n, TOPK)
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1))
    starts = qsl.tolist()
    for i, c in enumerate(contexts):
        rows = slice(starts[i], starts[i + 1])
        count = (c + lens[i]) // rate
        if not lens[i] or not count:
            continue
        scores = _index_scores(q[rows], weights[rows], _gather_keys(entries, table[i], 0, count),
                               scale)
        for j in range(lens[i]):
            g, w = got[rows][j], want[rows][j]
            a = scores[j, g[g >= 0]].sort().values
            b = scores[j, w[w >= 0]].sort().values
            torch.testing.assert_close(a, b, atol=1e-4 * scores[j].abs().max().item(), rtol=0)
    assert (got[starts[-1]:] == -1).all(), "padding rows pick nothing"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layer", ["hca", "csa"])
def test_compressed_attention_matches_reference(layer, dtype):
    from dspark_compile.kernels.compressed_attention import compressed_attention_triton

    gen = torch.Generator().manual_seed(2)
    rate = 128 if layer == "hca" else 4
    contexts, lens = [0, 300, 2100, 5, 40], [200, 3, 1, 0, 8]
    qsl, seq_lens, table, slots, pages = _layout(contexts, lens, 2304, gen)
    n = slots.shape[0]
    q = _rnd(gen, n, HEADS, D, dtype=dtype)
    kv = _rnd(gen, n, 1, D, dtype=dtype)  # K = V: one head, stored in both pools
    pools = [_rnd(gen, pages, PAGE, 1, D, dtype=dtype) for _ in range(2)]
    entries = _rnd(gen, pages, PAGE, D, dtype=dtype)
    sinks = _rnd(gen, HEADS, dtype=torch.float32)
    fresh = torch.zeros(n, D, dtype=dtype, device="cuda")
    picks = None
    if layer == "csa":  # valid picks (< (p + 1) // rate), -1 for the rest
        picks = torch.full((n, TOPK), -1, dtype=torch.int64)
        starts = qsl.tolist()
        for i, c in enumerate(contexts):
            for j in range(lens[i]):
                seen = (c + j + 1) // rate
                chosen = torch.randperm(seen, generator=gen)[:TOPK]
                picks[starts[i] + j, :chosen.numel()] = chosen
        picks = picks.cuda()
    got_pools, ref_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    rest = (qsl, seq_lens, table, slots, D ** -0.5, WINDOW, 0.0, sinks, entries, fresh, rate,
            picks)
    got = compressed_attention_triton(q, kv, kv, *got_pools, *rest)
    want = OPS.compressed_attention(q, kv, kv, *ref_pools, *rest)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[int(qsl[-1]):], torch.zeros_like(got[int(qsl[-1]):]))
    for a, b in zip(got_pools, ref_pools):
        assert torch.equal(a, b)
