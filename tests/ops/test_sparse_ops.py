"""The sparse-attention reference ops (``ops/sparse.py``) against formulas written out
independently: attention as a full causal softmax with every key outside the picks masked (HF's
eager DSA path), the indexer as scores over every earlier key and a top-k; block picks as HF's
MiniMax-M3 block mask (each indexer head's kept blocks broadcast to their keys and to its query
heads, and the causal mask), the block indexer as per-block maxima with the local blocks
always kept."""

from __future__ import annotations

import pytest
import torch
from helpers import paged_step

from dspark_compile.ops import sparse as _ops  # noqa: F401  (registers the ops)
from dspark_compile.ops.compressed_reference import dense_layout
from dspark_compile.ops.sparse_reference import (block_index, sparse_attention,
                                                 sparse_index)

PAGE = 4


def _layout(lens, contexts, pages_per_request=6, seed=0):
    """Packed layout of requests with ``lens`` new tokens after ``contexts``, pages scattered."""
    pages = len(lens) * pages_per_request
    return paged_step(contexts, lens, PAGE, pages, pages_per_request,
                      torch.Generator().manual_seed(seed))


def _masked_attention(q, keys, values, pos, picks, scale, sinks):
    """One query over a request's keys ``[S, H, D]``: a causal softmax with the keys outside
    ``picks`` at -inf (and a sink logit per head when given)."""
    logits = torch.einsum("hd,shd->hs", q.float(), keys.float()) * scale
    allowed = torch.zeros(keys.shape[0], dtype=torch.bool)
    valid = picks[(picks >= 0) & (picks <= pos)].long()
    allowed[valid] = True
    allowed[pos + 1:] = False
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.float()[:, None]], dim=1)
    if not allowed.any() and sinks is None:
        return torch.zeros(q.shape[0], values.shape[-1])
    probs = torch.softmax(logits, dim=-1)[:, :keys.shape[0]]
    return torch.einsum("hs,shd->hd", probs, values.float())


@pytest.mark.parametrize("heads,kv_heads,with_sinks", [(4, 2, False), (4, 4, True)])
def test_sparse_attention_is_the_causal_softmax_over_the_picked_keys(heads, kv_heads,
                                                                     with_sinks):
    torch.manual_seed(0)
    lens, contexts = [3, 1, 5], [6, 0, 9]
    qsl, seq, table, slots = _layout(lens, contexts)
    n, dk, dv = sum(lens), 12, 8
    pool_pages = table.numel()
    k_cache = torch.randn(pool_pages, PAGE, kv_heads, dk)
    v_cache = torch.randn(pool_pages, PAGE, kv_heads, dv)
    q, k, v = torch.randn(n, heads, dk), torch.randn(n, kv_heads, dk), torch.randn(n, kv_heads, dv)
    picks = torch.full((n, 5), -1, dtype=torch.int64)
    for i in range(n):
        picks[i, :4] = torch.randint(0, 16, (4,))  # some past the query: ignored
        picks[i] = torch.where(torch.rand(5) < 0.2, -1, picks[i])
    picks[1, :] = -1  # a row with no pick
    for i in range(n):  # distinct per row, as an indexer makes them
        seen, row = set(), picks[i].tolist()
        picks[i] = torch.tensor([p if p not in seen and not seen.add(p) else -1 for p in row])
    sinks = torch.randn(heads) if with_sinks else None
    kc, vc = k_cache.clone(), v_cache.clone()
    out = sparse_attention(q, k, v, kc, vc, qsl, seq, table, slots, 0.3, picks, sinks)
    flat_k, flat_v = kc.view(-1, kv_heads, dk), vc.view(-1, kv_heads, dv)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    group = heads // kv_heads
    for i, (c, ln) in enumerate(zip(contexts, lens)):
        rows = [int(table[i, p // PAGE]) * PAGE + p % PAGE for p in range(c + ln)]
        keys = flat_k[rows].repeat_interleave(group, dim=1)
        values = flat_v[rows].repeat_interleave(group, dim=1)
        for j in range(ln):
            t = int(qsl[i]) + j
            want = _masked_attention(q[t], keys, values, c + j, picks[t], 0.3, sinks)
            torch.testing.assert_close(out[t].float(), want, rtol=1e-5, atol=1e-5)


def test_dense_sparse_index_writes_the_keys_and_keeps_each_querys_best_earlier_keys():
    torch.manual_seed(1)
    bs, t, heads, dim, topk = 2, 5, 8, 16, 3
    contexts = torch.tensor([4, 0], dtype=torch.int32)
    table = torch.randperm(bs * 4).view(bs, 4).to(torch.int32)
    pool = torch.randn(bs * 4, PAGE, dim)
    q, k = torch.randn(bs, t, heads, dim), torch.randn(bs, t, dim)
    weights = torch.randn(bs, t, heads)
    picks = torch.ops.dspark.dense_sparse_index(q, weights, k, pool, table, contexts, topk, 0.25)
    assert picks.shape == (bs, t, topk) and picks.dtype == torch.int64
    _, _, slots = dense_layout(bs, t, contexts, table, PAGE, q.device)
    flat = pool.view(-1, dim)
    assert torch.equal(flat[slots].view(bs, t, dim), k)
    for b in range(bs):
        c = int(contexts[b])
        rows = [int(table[b, p // PAGE]) * PAGE + p % PAGE for p in range(c + t)]
        keys = flat[rows]
        for j in range(t):
            pos = c + j
            scores = (torch.relu(torch.einsum("hd,sd->hs", q[b, j], keys[:pos + 1])) * 0.25
                      * weights[b, j][:, None]).sum(0)
            want = scores.topk(min(topk, pos + 1)).indices
            got = picks[b, j]
            assert set(got[got >= 0].tolist()) == set(want.tolist()), (b, j)
            assert int((got < 0).sum()) == topk - min(topk, pos + 1)


def test_the_sparse_ops_refuse_bad_arguments_by_name():
    qsl, seq, table, slots = _layout([2], [1])
    q, k = torch.randn(2, 4, 8), torch.randn(2, 8)
    pool = torch.zeros(table.numel(), PAGE, 8)
    with pytest.raises(ValueError, match="topk=0"):
        sparse_index(q, torch.randn(2, 4), k, pool, qsl, seq, table, slots, 0, 1.0)
    with pytest.raises(ValueError, match="one indexer key per row"):
        sparse_index(q, torch.randn(2, 4), k[:1], pool, qsl, seq, table, slots, 2, 1.0)
    caches = torch.zeros(table.numel(), PAGE, 2, 8)
    kv = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="picks is torch.float32"):
        sparse_attention(q, kv, kv, caches, caches, qsl, seq, table, slots, 1.0,
                         torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sinks"):
        sparse_attention(q, kv, kv, caches, caches, qsl, seq, table, slots, 1.0,
                         torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3))


@pytest.mark.parametrize("heads,kv_heads,pick_rows,block", [
    (4, 2, 4, 3),   # a pick row per query head (HF's tiny MiniMax-M3: 4 indexer heads, 2 KV)
    (4, 2, 2, 4),   # a pick row per KV head (MiniMax-M3: index heads = KV heads)
    (6, 3, 1, 2),   # one row for every head, blocks of 2
    (4, 4, 2, 1),   # rows shared by two KV heads, single positions
    (6, 3, 2, 2),   # a pick row and a KV head share one query head in three (gcd 1)
])
def test_block_picks_are_hfs_block_mask(heads, kv_heads, pick_rows, block):
    """Picks ``[N, Hp, P]`` of blocks: query head ``h`` attends causally to the positions of
    the blocks in row ``h // (H / Hp)``, the keys of a block past the query masked."""
    torch.manual_seed(2)
    lens, contexts = [4, 1, 6], [7, 0, 10]
    qsl, seq, table, slots = _layout(lens, contexts)
    n, dk, dv = sum(lens), 12, 8
    k_cache = torch.randn(table.numel(), PAGE, kv_heads, dk)
    v_cache = torch.randn(table.numel(), PAGE, kv_heads, dv)
    q, k, v = torch.randn(n, heads, dk), torch.randn(n, kv_heads, dk), torch.randn(n, kv_heads, dv)
    picks = torch.full((n, pick_rows, 3), -1, dtype=torch.int64)
    for t in range(n):
        for r in range(pick_rows):
            chosen = torch.randperm(7)[:3]  # some blocks past the query: ignored
            picks[t, r] = torch.where(torch.rand(3) < 0.25, -1, chosen)
    picks[0, :] = -1  # a row with no pick
    kc, vc = k_cache.clone(), v_cache.clone()
    out = sparse_attention(q, k, v, kc, vc, qsl, seq, table, slots, 0.3, picks, None, block)
    flat_k, flat_v = kc.view(-1, kv_heads, dk), vc.view(-1, kv_heads, dv)
    group, span = heads // kv_heads, heads // pick_rows
    for i, (c, ln) in enumerate(zip(contexts, lens)):
        rows = [int(table[i, p // PAGE]) * PAGE + p % PAGE for p in range(c + ln)]
        keys = flat_k[rows].repeat_interleave(group, dim=1)
        values = flat_v[rows].repeat_interleave(group, dim=1)
        for j in range(ln):
            t, pos = int(qsl[i]) + j, c + j
            for h in range(heads):
                kept = torch.zeros(c + ln, dtype=torch.bool)  # HF: block mask & causal
                for b in picks[t, h // span].tolist():
                    if b >= 0:
                        kept[b * block:(b + 1) * block] = True
                kept[pos + 1:] = False
                if not kept.any():
                    want = torch.zeros(dv)
                else:
                    logits = (keys[:, h] @ q[t, h]) * 0.3
                    probs = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=0)
                    want = probs @ values[:, h]
                torch.testing.assert_close(out[t, h], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block,topk,local", [(3, 2, 1), (2, 3, 2), (4, 2, 0), (1, 4, 1)])
def test_dense_block_index_keeps_each_heads_best_blocks_and_the_local_ones(block, topk, local):
    torch.manual_seed(3)
    bs, t, heads, dim = 2, 5, 3, 16
    contexts = torch.tensor([9, 0], dtype=torch.int32)
    table = torch.randperm(bs * 5).view(bs, 5).to(torch.int32)
    pool = torch.randn(bs * 5, PAGE, dim)
    q, k = torch.randn(bs, t, heads, dim), torch.randn(bs, t, dim)
    picks = torch.ops.dspark.dense_block_index(q, k, pool, table, contexts, block, topk, local)
    assert picks.shape == (bs, t, heads, topk) and picks.dtype == torch.int64
    _, _, slots = dense_layout(bs, t, contexts, table, PAGE, q.device)
    flat = pool.view(-1, dim)
    assert torch.equal(flat[slots].view(bs, t, dim), k)
    for b in range(bs):
        c = int(contexts[b])
        keys = flat[[int(table[b, p // PAGE]) * PAGE + p % PAGE for p in range(c + t)]]
        for j in range(t):
            pos = c + j
            own = pos // block
            for h in range(heads):
                maxima = {blk: max(float(q[b, j, h] @ keys[s])
                                   for s in range(blk * block, min(pos + 1, (blk + 1) * block)))
                          for blk in range(own + 1)}
                forced = {blk for blk in maxima if blk > own - local}
                rest = sorted((blk for blk in maxima if blk not in forced),
                              key=lambda blk: -maxima[blk])
                want = forced | set(rest[:max(0, topk - len(forced))])
                got = picks[b, j, h]
                assert set(got[got >= 0].tolist()) == want, (b, j, h)
                assert int((got < 0).sum()) == topk - len(want)


def test_the_block_ops_refuse_bad_arguments_by_name():
    qsl, seq, table, slots = _layout([2], [1])
    q, k = torch.randn(2, 4, 8), torch.randn(2, 8)
    pool = torch.zeros(table.numel(), PAGE, 8)
    with pytest.raises(ValueError, match="block_size=0"):
        block_index(q, k, pool, qsl, seq, table, slots, 0, 2, 1)
    with pytest.raises(ValueError, match="local=3; it must be an int in 0 .. topk=2"):
        block_index(q, k, pool, qsl, seq, table, slots, 4, 2, 3)
    caches = torch.zeros(table.numel(), PAGE, 2, 8)
    kv = torch.randn(2, 2, 8)
    picks = torch.zeros(2, 3, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"picks is torch.int64 \(2, 3, 5\).*Hp dividing"):
        sparse_attention(q, kv, kv, caches, caches, qsl, seq, table, slots, 1.0, picks)
    with pytest.raises(ValueError, match="pick_block=0"):
        sparse_attention(q, kv, kv, caches, caches, qsl, seq, table, slots, 1.0, picks[:, :2],
                         None, 0)
