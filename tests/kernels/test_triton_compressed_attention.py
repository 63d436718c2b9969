"""The Triton compressed attention (``kernels/compressed_attention.py``) against
``dspark::compressed_attention``'s reference, under the interpreter on the CPU (as is on a GPU):
HCA (every closed entry) and CSA (picks with -1 holes), windows shorter and longer than the
context, with and without sinks, more keys than one tile, an empty request and a padding row,
over NaN-poisoned pools; float32 within rounding, bf16 within a few bf16 ulps."""

from __future__ import annotations

import pytest
import torch

from dspark_compile.kernels.compressed_attention import compressed_attention_triton
from dspark_compile.ops import compressed_reference as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, PAGES, HEADS, DIM = 4, 48, 4, 32


def _case(gen, rate, with_picks, dtype, lens=(4, 0, 3), ctx=(29, 5, 0), picks_per=3):
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache = torch.full((PAGES, PAGE, 1, DIM), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    entries = torch.full((PAGES, PAGE, DIM), float("nan"), dtype=dtype)
    table = torch.randperm(PAGES, generator=gen)[:36].view(3, 12).int()
    slots, picks = [], []
    for i in range(3):
        total = ctx[i] + lens[i]
        pos = torch.arange(ctx[i])
        rows = table[i].long()[pos // PAGE] * PAGE + pos % PAGE
        old = rand(ctx[i], DIM)
        k_cache.view(-1, DIM)[rows], v_cache.view(-1, DIM)[rows] = old, old
        w = torch.arange(total // rate)
        entries.view(-1, DIM)[table[i].long()[w // PAGE] * PAGE + w % PAGE] = rand(w.numel(),
                                                                                    DIM)
        pos = torch.arange(ctx[i], total)
        slots.append(table[i].long()[pos // PAGE] * PAGE + pos % PAGE)
        for j in range(lens[i]):
            seen = (ctx[i] + j + 1) // rate
            chosen = torch.randperm(max(seen, 1), generator=gen)[:min(picks_per, seen)]
            row = torch.full((picks_per,), -1, dtype=torch.int64)
            row[torch.randperm(picks_per, generator=gen)[:chosen.numel()]] = chosen
            picks.append(row)
    n = sum(lens)
    qsl = torch.tensor([0, lens[0], lens[0] + lens[1], n], dtype=torch.int32)
    seq = torch.tensor([c + m for c, m in zip(ctx, lens)], dtype=torch.int32)
    q, kv = rand(n + 1, HEADS, DIM), rand(n + 1, 1, DIM)  # one padding row
    slot_mapping = torch.cat(slots + [torch.tensor([-1])])
    topk = torch.cat([torch.stack(picks), torch.full((1, picks_per), -1)]) if with_picks \
        else None
    fresh = torch.zeros(n + 1, DIM, dtype=dtype)
    dev = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t
           for t in (q, kv, k_cache, v_cache, qsl, seq, table, slot_mapping, entries, fresh,
                     topk)]
    return dev


@pytest.mark.parametrize("window, with_picks, with_sinks", [
    (5, False, True), (5, True, True), (0, False, False), (40, True, False), (3, True, True)],
    ids=["hca_sinks", "csa_sinks", "hca_causal", "csa_window_past_context", "csa_short_window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_compressed_attention_matches_reference(window, with_picks, with_sinks, dtype):
    gen = torch.Generator().manual_seed(window * 3 + with_picks)
    rate = 2 if with_picks else 4
    q, kv, kc, vc, qsl, seq, table, slots, entries, fresh, topk = _case(gen, rate, with_picks,
                                                                       dtype)
    sinks = torch.randn(HEADS, generator=gen).to(DEVICE) if with_sinks else None
    mine_k, mine_v = kc.clone(), vc.clone()
    want = reference.compressed_attention(q, kv, kv, kc, vc, qsl, seq, table, slots, 0.3,
                                          window, 0.0, sinks, entries, fresh, rate, topk)
    got = compressed_attention_triton(q, kv, kv, mine_k, mine_v, qsl, seq, table, slots, 0.3,
                                      window, 0.0, sinks, entries, fresh, rate, topk)
    tol = dict(rtol=0, atol=3e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    assert torch.equal(mine_k.nan_to_num(7.0), kc.nan_to_num(7.0))  # the new rows landed
    assert torch.equal(mine_v.nan_to_num(7.0), vc.nan_to_num(7.0))


def test_triton_compressed_attention_refuses_by_name():
    q, kv = torch.zeros(3, 4, 32), torch.zeros(3, 2, 32)
    caches = torch.zeros(8, 4, 2, 32)
    meta = (torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, 2, dtype=torch.int32), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="one K=V head"):
        compressed_attention_triton(q, kv, kv, caches, caches, *meta, 0.3, 4, 0.0, None,
                                    torch.zeros(8, 4, 32), torch.zeros(3, 32), 4, None)
    with pytest.raises(ValueError, match="fresh is"):
        compressed_attention_triton(q, kv, kv, caches, caches, *meta, 0.3, 4, 0.0, None,
                                    torch.zeros(8, 4, 32), torch.zeros(2, 32), 4, None)
