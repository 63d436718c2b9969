"""Containment and ties of the compressed-op Triton kernels (``kernels/compress.py``,
``index_topk.py``, ``compressed_attention.py``) against their references, under the
interpreter on the CPU (as is on a GPU), float32 at small odd shapes.

A step's last rows are a rejected draft whose inputs are NaN: no earlier row's output, no entry
of a window that closes before them, and no pool row outside the step's own may change; padding
rows (NaN inputs too) write nothing and come out as zeros. Every pool row the step may not
read is NaN. The indexer's equal scores: the picks above the tied score are the reference's,
and the tied ones are the lowest tied indices (the reference takes as many from the tied
entries, by its device's ``torch.topk``).
"""

from __future__ import annotations

import pytest
import torch
from helpers import paged_step

from dspark_compile.kernels.compress import compress_triton
from dspark_compile.kernels.compressed_attention import compressed_attention_triton
from dspark_compile.kernels.index_topk import index_topk_triton
from dspark_compile.ops import compressed_reference as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4
NAN = float("nan")
# contexts and step lengths of four requests (one empty); the last POISON rows of request 3
# are the rejected draft; two padding rows follow
CONTEXTS, LENS, POISON, PAD = [0, 5, 13, 6], [7, 0, 3, 9], 3, 2


def _layout(gen, max_context=40):
    per = -(-max_context // PAGE)
    pages = len(LENS) * per + 3
    return (*paged_step(CONTEXTS, LENS, PAGE, pages, per, gen, PAD), pages)


def _fill(pool, table, counts, gen):
    """Rows ``0 .. counts[i] - 1`` of each request random; everything else stays NaN."""
    flat = pool.view(-1, *pool.shape[2:])
    for i, c in enumerate(counts):
        p = torch.arange(c)
        flat[table[i].long()[p // PAGE] * PAGE + p % PAGE] = torch.randn(
            c, *pool.shape[2:], generator=gen)


def _poison(x, qsl):
    """NaN in the rejected rows and the padding rows of a packed input."""
    x = x.clone()
    end = int(qsl[-1])
    x[end - POISON:] = NAN
    return x


def _clean_rows(qsl):
    """Rows whose inputs are all finite and precede no rejected row of their request."""
    return torch.arange(int(qsl[-1]) - POISON)


def _to(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the rejected rows' max
@pytest.mark.parametrize("overlap, rate", [(False, 4), (True, 2), (False, 1)],
                         ids=["hca", "csa", "hca_rate1"])
def test_compress_rejected_rows_reach_no_earlier_row(overlap, rate):
    gen = torch.Generator().manual_seed(rate)
    dim = 8
    width = 2 * dim if overlap else dim
    qsl, seq, table, slots, pages = _layout(gen)
    raw = [torch.full((pages, PAGE, width), NAN) for _ in range(2)]
    for pool in raw:
        _fill(pool, table, CONTEXTS, gen)
    entries = torch.full((pages, PAGE, dim), NAN)
    _fill(entries, table, [c // rate for c in CONTEXTS], gen)
    n = slots.shape[0]
    kv = _poison(torch.randn(n, width, generator=gen), qsl)
    gate = _poison(torch.randn(n, width, generator=gen), qsl)
    rest = _to(qsl, seq, table, slots, torch.randn(rate, width, generator=gen),
               torch.randn(dim, generator=gen), torch.rand(2, generator=gen))
    rest += [rate, overlap, 1e-6, 0.8]
    pools = _to(*raw, entries)
    mine = [p.clone() for p in pools]
    kv, gate = _to(kv, gate)
    want = reference.compress(kv, gate, *pools, *rest)
    got = compress_triton(kv, gate, *mine, *rest)
    clean = _clean_rows(qsl)
    assert torch.isfinite(got[clean]).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(got[-PAD:], torch.zeros_like(got[-PAD:])), "padding rows"
    for a, b in zip(mine, pools):  # NaN where nothing was written, the same bits elsewhere
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert int(want[clean].ne(0).any(1).sum()) >= 3, "the case closes too few windows"


def _index_case(gen, rate, heads=8, dim=8):
    qsl, seq, table, _, pages = _layout(gen)
    pool = torch.full((pages, PAGE, dim), NAN)
    _fill(pool, table, [int(s) // rate for s in seq], gen)
    n = int(qsl[-1]) + PAD
    q = _poison(torch.randn(n, heads, dim, generator=gen), qsl)
    weights = torch.rand(n, heads, generator=gen) + 0.1
    return q, weights, pool, torch.zeros(n, dim), qsl, seq, table


def test_index_topk_rejected_rows_reach_no_earlier_row():
    gen = torch.Generator().manual_seed(5)
    rate, topk = 2, 3
    q, weights, pool, fresh, qsl, seq, table = _index_case(gen, rate)
    args = _to(q, weights, pool, fresh, qsl, seq, table) + [rate, topk, 0.5]
    got, want = index_topk_triton(*args), reference.index_topk(*args)
    clean = _clean_rows(qsl)
    assert torch.equal(got[clean].sort(1).values, want[clean].sort(1).values)
    assert (got[-PAD:] == -1).all(), "padding rows pick nothing"


def test_index_topk_equal_scores():
    """Entries 0 .. 5 of every request are one row (so their scores are equal bit for bit),
    entry 6 is twice it (better) and later ones half of it (worse): each query keeps entry 6
    when it sees it, and fills the rest of its picks from the tied entries, as many as the
    reference does; the kernel takes the lowest tied indices (its keys order equal scores by
    index, on every device), where the reference leaves the choice to ``torch.topk``."""
    gen = torch.Generator().manual_seed(6)
    rate, topk = 2, 4
    q, weights, pool, fresh, qsl, seq, table = _index_case(gen, rate)
    q = q.abs()  # positive dots: no ReLU zeros
    flat = pool.view(-1, pool.shape[-1])
    base = torch.rand(pool.shape[-1], generator=gen) + 0.1
    for i in range(len(LENS)):
        for s in range(int(seq[i]) // rate):
            row = table[i].long()[s // PAGE] * PAGE + s % PAGE
            flat[row] = base * (2.0 if s == 6 else 1.0 if s < 6 else 0.5)
    args = _to(q, weights, pool, fresh, qsl, seq, table) + [rate, topk, 0.5]
    got, want = index_topk_triton(*args), reference.index_topk(*args)
    starts = qsl.tolist()
    for i, c in enumerate(CONTEXTS):
        for j in range(LENS[i] - (POISON if i == len(LENS) - 1 else 0)):
            seen = (c + j + 1) // rate
            g, w = got[starts[i] + j], want[starts[i] + j]
            assert int((g >= 0).sum()) == int((w >= 0).sum()) == min(topk, seen)
            assert (6 in g.tolist()) == (6 in w.tolist()) == (seen > 6)
            assert all(0 <= s < min(seen, 7) for s in w.tolist() if s >= 0)
            # the kernel's own rule, on every device: higher score first, then lower index
            best = [6] if seen > 6 else []
            rule = best + list(range(min(topk, seen) - len(best)))
            assert g.tolist() == rule + [-1] * (topk - len(rule))


@pytest.mark.parametrize("topk_rows", [False, True], ids=["hca", "csa"])
def test_compressed_attention_rejected_rows_reach_no_earlier_row(topk_rows):
    gen = torch.Generator().manual_seed(7)
    dim, heads, rate, window = 16, 20, 2, 6  # 20 heads: two head blocks, one partial
    qsl, seq, table, slots, pages = _layout(gen)
    kc = torch.full((pages, PAGE, 1, dim), NAN)
    _fill(kc, table, CONTEXTS, gen)
    vc = kc.clone()  # K = V
    entries = torch.full((pages, PAGE, dim), NAN)
    _fill(entries, table, [int(s) // rate for s in seq], gen)
    n = slots.shape[0]
    q = _poison(torch.randn(n, heads, dim, generator=gen), qsl)
    kv = _poison(torch.randn(n, 1, dim, generator=gen), qsl)
    picks = None
    if topk_rows:
        picks = torch.full((n, 3), -1, dtype=torch.int64)
        starts = qsl.tolist()
        for i, c in enumerate(CONTEXTS):
            for j in range(LENS[i]):
                chosen = torch.randperm((c + j + 1) // rate, generator=gen)[:3]
                picks[starts[i] + j, :chosen.numel()] = chosen
    sinks = torch.randn(heads, generator=gen)
    pools = _to(kc, vc)
    mine = [p.clone() for p in pools]
    args = _to(qsl, seq, table, slots) + [0.3, window, 0.0] + _to(sinks, entries,
                                                                   torch.zeros(n, dim))
    q, kv = _to(q, kv)
    want = reference.compressed_attention(q, kv, kv, *pools, *args, rate, _to(picks)[0])
    got = compressed_attention_triton(q, kv, kv, *mine, *args, rate, _to(picks)[0])
    clean = _clean_rows(qsl)
    assert torch.isfinite(got[clean]).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(got[-PAD:], torch.zeros_like(got[-PAD:])), "padding rows"
    for a, b in zip(mine, pools):
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)
