"""The Triton sparse-attention ops (``kernels/sparse.py``) against ``dspark::sparse_attention``
and ``dspark::sparse_index``'s references, under the interpreter on the CPU (as is on a GPU):
a ragged step of requests with contexts (one empty, one of a single row), pages scattered
through the block table, padding rows (slot -1, past the last request), GQA and MHA, Dk != Dv
and neither a power of two, picks with -1 holes, positions past the query (inside the step and
past the sequence), rows with no valid pick, pick counts that are not a multiple of the tile,
with and without sinks, over NaN-poisoned pools; per-head and block picks (MiniMax-M3) and the
block indexer the same way. The pools after the call equal the reference's; float32 within
rounding, bf16 within a few bf16 ulps."""

from __future__ import annotations

import pytest
import torch
from helpers import paged_step

from dspark_compile.kernels.sparse import (SparseAttentionPlan, block_index_triton,
                                           sparse_attention_triton, sparse_index_triton)
from dspark_compile.ops import sparse_reference as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, PAGES = 4, 64
LENS, CONTEXTS = (3, 0, 5, 1), (9, 4, 0, 30)
PAD_ROWS = 2


def _layout(gen):
    """``(qsl, seq_lens, block_table, slot_mapping)`` of the step (padding rows: slot -1) and
    each request's context and row range."""
    return paged_step(CONTEXTS, LENS, PAGE, PAGES, 12, gen, PAD_ROWS)


def _poisoned_pool(gen, table, width_shape, dtype):
    """A NaN pool ``[PAGES, PAGE, *width_shape]`` with each request's context rows random."""
    pool = torch.full((PAGES, PAGE, *width_shape), float("nan"), dtype=dtype)
    flat = pool.view(PAGES * PAGE, *width_shape)
    for i, c in enumerate(CONTEXTS):
        pos = torch.arange(c)
        flat[table[i].long()[pos // PAGE] * PAGE + pos % PAGE] = torch.randn(
            c, *width_shape, generator=gen).to(dtype)
    return pool


def _picks(gen, qsl, seq, num_picks):
    """Each real row: distinct valid positions (some), -1 holes, positions past the query
    (inside the step where there are some, and past the sequence); its first row picks nothing
    valid. Padding rows: random positions (the kernel must ignore them)."""
    n = int(qsl[-1]) + PAD_ROWS
    picks = torch.randint(-1, 40, (n, num_picks), generator=gen)
    for i, (c, length) in enumerate(zip(CONTEXTS, LENS)):
        for j in range(length):
            row, p = int(qsl[i]) + j, c + j
            out = torch.full((num_picks,), -1, dtype=torch.int64)
            chosen = torch.randperm(p + 1, generator=gen)[:min(num_picks // 2, p + 1)]
            if j == 0:
                chosen = chosen[:0]
            past = p + 1 + torch.randint(0, 8, (3,), generator=gen)  # past the query
            fill = torch.cat([chosen, past, torch.tensor([int(seq[i]) + 5])])[:num_picks]
            out[torch.randperm(num_picks, generator=gen)[:fill.numel()]] = fill
            picks[row] = out
    return picks


def _dev(*tensors):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


CASES = {
    # (H, Hkv, Dk, Dv, picks per row, sinks, tile of picks (None: the plan's))
    "gqa_dk24_dv16": (4, 2, 24, 16, 37, False, None),
    "gqa_sinks_tiles16": (4, 2, 24, 16, 50, True, 16),
    "mha_dk40_dv24": (2, 2, 40, 24, 21, False, None),
}
DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
          "fp32_rows_bf16_pools": (torch.float32, torch.bfloat16)}


def _attention_matches_reference(gen, heads, hkv, dk, dv, row_ty, pool_ty, make_picks,
                                 with_sinks, pick_block=1, plan=None):
    """Pools, rows, ``make_picks(qsl, seq_lens, n)`` and sinks drawn from ``gen``; the Triton
    op against the reference: outputs within rounding (float32) or a few bf16 ulps, padding
    rows zeros, the K and V pools the reference's. Returns the output (on the host's rows)."""
    qsl, seq, table, slots = _layout(gen)
    n = slots.shape[0]
    k_cache = _poisoned_pool(gen, table, (hkv, dk), pool_ty)
    v_cache = _poisoned_pool(gen, table, (hkv, dv), pool_ty)
    q = torch.randn(n, heads, dk, generator=gen).to(row_ty)
    k = torch.randn(n, hkv, dk, generator=gen).to(row_ty)
    v = torch.randn(n, hkv, dv, generator=gen).to(row_ty)
    picks = make_picks(qsl, seq, n)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    q, k, v, qsl, seq, table, slots, picks, sinks = _dev(q, k, v, qsl, seq, table, slots,
                                                         picks, sinks)
    ref_k, ref_v = [p.to(DEVICE) for p in (k_cache, v_cache)]
    got_k, got_v = ref_k.clone(), ref_v.clone()
    want = reference.sparse_attention(q, k, v, ref_k, ref_v, qsl, seq, table, slots, 0.3, picks,
                                      sinks, pick_block)
    got = sparse_attention_triton(q, k, v, got_k, got_v, qsl, seq, table, slots, 0.3, picks,
                                  sinks, pick_block, plan=plan)
    assert got.shape == (n, heads, dv) and got.dtype == q.dtype
    tol = dict(rtol=0, atol=3e-6) if row_ty == torch.float32 else dict(rtol=2 ** -6,
                                                                          atol=2 ** -6)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    real = int(qsl[-1])
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding rows are zeros"
    assert torch.equal(got_k.nan_to_num(7.0), ref_k.nan_to_num(7.0)), "K rows as the reference"
    assert torch.equal(got_v.nan_to_num(7.0), ref_v.nan_to_num(7.0)), "V rows as the reference"
    return got


@pytest.mark.parametrize("dtypes", sorted(DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_sparse_attention_matches_reference(case, dtypes):
    heads, hkv, dk, dv, num_picks, with_sinks, tile = CASES[case]
    row_ty, pool_ty = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(num_picks + dk)
    plan = None if tile is None else SparseAttentionPlan(16, 1, tile, 4)
    got = _attention_matches_reference(
        gen, heads, hkv, dk, dv, row_ty, pool_ty,
        lambda qsl, seq, n: _picks(gen, qsl, seq, num_picks), with_sinks, plan=plan)
    assert torch.equal(got[0], torch.zeros_like(got[0])), "no valid pick: zeros"


def _float32_matches_reference(q, k, v, k_cache, v_cache, qsl, seq, table, slots, picks):
    """The Triton op (scale 0.25, no sinks) against the reference on the device: outputs within
    float32 rounding, the K and V pools the reference's."""
    args = _dev(q, k, v, k_cache, v_cache, qsl, seq, table, slots)
    picks = picks.to(DEVICE)
    ref_pools = [args[3], args[4]]
    got_pools = [p.clone() for p in ref_pools]
    want = reference.sparse_attention(*args, 0.25, picks)
    got = sparse_attention_triton(*args[:3], *got_pools, *args[5:], 0.25, picks)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-6)
    for a, b in zip(got_pools, ref_pools):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_triton_sparse_attention_long_pick_rows():
    """Rows of 300 picks (ten tiles, the last partial), most of them -1 or past the query, as
    an indexer's ``topk`` row is on a short sequence."""
    gen = torch.Generator().manual_seed(5)
    qsl, seq, table, slots = _layout(gen)
    n = slots.shape[0]
    k_cache = _poisoned_pool(gen, table, (1, 32), torch.float32)
    v_cache = _poisoned_pool(gen, table, (1, 32), torch.float32)
    q = torch.randn(n, 2, 32, generator=gen)
    k, v = torch.randn(n, 1, 32, generator=gen), torch.randn(n, 1, 32, generator=gen)
    picks = _picks(gen, qsl, seq, 300)
    _float32_matches_reference(q, k, v, k_cache, v_cache, qsl, seq, table, slots, picks)


def test_triton_sparse_attention_takes_rows_that_are_views():
    """DeepSeek-V3.2 hands over its values as a slice of its key-value projection (and its
    queries as views): the op makes such rows dense and matches the reference (it refused
    them on a GPU before)."""
    gen = torch.Generator().manual_seed(11)
    qsl, seq, table, slots = _layout(gen)
    n = slots.shape[0]
    k_cache = _poisoned_pool(gen, table, (1, 24), torch.float32)
    v_cache = _poisoned_pool(gen, table, (1, 16), torch.float32)
    kv = torch.randn(n, 1, 24 + 16, generator=gen)
    q = torch.randn(n, 32, 2, generator=gen).transpose(1, 2)[:, :, :24]
    k, v = kv[..., :24], kv[..., 24:]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    picks = _picks(gen, qsl, seq, 21)
    _float32_matches_reference(q, k, v, k_cache, v_cache, qsl, seq, table, slots, picks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("topk", [6, 40], ids=["topk6", "topk_past_every_count"])
def test_triton_sparse_index_matches_reference(topk, dtype):
    """Scores have no ties (positive q and keys: no ReLU zero), so the picks are the
    reference's (as sets; rows are compared sorted). bf16: the float32 step keys are rounded
    into the bf16 pool as the reference rounds them."""
    gen = torch.Generator().manual_seed(topk)
    heads, dim = 4, 24
    qsl, seq, table, slots = _layout(gen)
    n = slots.shape[0]
    pool = torch.full((PAGES, PAGE, dim), float("nan"), dtype=dtype)
    flat = pool.view(-1, dim)
    for i, c in enumerate(CONTEXTS):
        pos = torch.arange(c)
        flat[table[i].long()[pos // PAGE] * PAGE + pos % PAGE] = torch.rand(
            c, dim, generator=gen).to(dtype)
    q = (torch.rand(n, heads, dim, generator=gen) + 0.05).to(dtype)
    weights = torch.randn(n, heads, generator=gen)
    k = torch.rand(n, dim, generator=gen)  # float32 rows into the pool's dtype
    q, weights, k, qsl, seq, table, slots = _dev(q, weights, k, qsl, seq, table, slots)
    ref_pool = pool.to(DEVICE)
    got_pool = ref_pool.clone()
    want = reference.sparse_index(q, weights, k, ref_pool, qsl, seq, table, slots, topk, 0.2)
    got = sparse_index_triton(q, weights, k, got_pool, qsl, seq, table, slots, topk, 0.2)
    assert got.shape == want.shape == (n, topk) and got.dtype == torch.int64
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
    assert (got[int(qsl[-1]):] == -1).all(), "padding rows pick nothing"
    assert torch.equal(got_pool.nan_to_num(7.0), ref_pool.nan_to_num(7.0))


BLOCK_CASES = {
    # (H, Hkv, pick rows, pick block, picks per row, sinks, dtype)
    "row_per_head_block3": (4, 2, 4, 3, 5, False, torch.float32),
    "row_per_kv_head_block4": (8, 2, 2, 4, 3, False, torch.float32),
    "rows_across_kv_heads_block2_sinks": (4, 4, 2, 2, 6, True, torch.float32),
    "one_row_block5": (4, 2, 1, 5, 4, False, torch.float32),
    "rows_and_kv_heads_gcd1": (6, 3, 2, 3, 4, False, torch.float32),
    "row_per_kv_head_bf16": (8, 2, 2, 4, 3, False, torch.bfloat16),
}


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_triton_block_picks_match_reference(case):
    """Picks ``[N, Hp, P]`` of blocks (ids up to past the sequence, -1 holes, padding rows
    random), the query's own block cut at its position."""
    heads, hkv, rows, block, num_picks, with_sinks, dtype = BLOCK_CASES[case]
    gen = torch.Generator().manual_seed(heads * 10 + rows + block)

    def block_picks(qsl, seq, n):
        picks = torch.full((n, rows, num_picks), -1, dtype=torch.int64)
        for t in range(n):
            for r in range(rows):
                chosen = torch.randperm(40 // block, generator=gen)[:num_picks]
                holes = torch.rand(num_picks, generator=gen) < 0.2
                picks[t, r] = torch.where(holes, -1, chosen)
        return picks

    _attention_matches_reference(gen, heads, hkv, 24, 16, dtype, dtype, block_picks,
                                 with_sinks, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block, topk, local", [(4, 2, 1), (3, 3, 2), (5, 16, 0), (1, 6, 1)],
                         ids=["b4_top2_local1", "b3_top3_local2", "b5_top_past_every_count",
                              "b1_top6_local1"])
def test_triton_block_index_matches_reference(block, topk, local, dtype):
    """Per-head block maxima of random scores have no ties, so the picks are the reference's
    (as sets; rows are compared sorted); -1 where a query has fewer blocks."""
    gen = torch.Generator().manual_seed(block * 7 + topk)
    heads, dim = 3, 24
    qsl, seq, table, slots = _layout(gen)
    n = slots.shape[0]
    pool = _poisoned_pool(gen, table, (dim,), dtype)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k = torch.randn(n, dim, generator=gen)  # float32 rows into the pool's dtype
    q, k, qsl, seq, table, slots = _dev(q, k, qsl, seq, table, slots)
    ref_pool = pool.to(DEVICE)
    got_pool = ref_pool.clone()
    want = reference.block_index(q, k, ref_pool, qsl, seq, table, slots, block, topk, local)
    got = block_index_triton(q, k, got_pool, qsl, seq, table, slots, block, topk, local)
    assert got.shape == want.shape == (n, heads, topk) and got.dtype == torch.int64
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
    assert (got[int(qsl[-1]):] == -1).all(), "padding rows pick nothing"
    assert torch.equal(got_pool.nan_to_num(7.0), ref_pool.nan_to_num(7.0))


@pytest.mark.parametrize("name, bad, match", [
    ("block_size", 0, "block_size=0"),
    ("local", 5, "local=5"),
    ("k", torch.zeros(3, 6), "k is"),
    ("key_pool", torch.zeros(8, PAGE, 16, dtype=torch.int32), "key_pool is"),
    ("key_pool", torch.zeros(8, PAGE, 8, dtype=torch.int32), "key_pool is torch.int32"),
    ("slot_mapping", torch.zeros(4, dtype=torch.int64), "slot_mapping .* N"),
    ("key_pool", torch.zeros(8, 8, PAGE).transpose(1, 2), "key_pool is on .*not contiguous"),
], ids=["block_size", "local_past_topk", "k_shape", "key_pool_dim", "key_pool_int",
        "slot_mapping_len", "key_pool_strided"])
def test_triton_block_index_refuses_by_name(name, bad, match):
    args = dict(q=torch.zeros(3, 4, 8), k=torch.zeros(3, 8), key_pool=torch.zeros(8, PAGE, 8),
                query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                seq_lens=torch.tensor([3], dtype=torch.int32),
                block_table=torch.zeros(1, 2, dtype=torch.int32),
                slot_mapping=torch.full((3,), -1, dtype=torch.int64), block_size=4, topk=4,
                local=1)
    args[name] = bad
    with pytest.raises(ValueError, match=f"block_index_triton: .*{match}"):
        block_index_triton(**args)


def _attention_args():
    n, heads, hkv, dk, dv, r = 3, 4, 2, 24, 16, 2
    return dict(q=torch.zeros(n, heads, dk), k=torch.zeros(n, hkv, dk),
                v=torch.zeros(n, hkv, dv), k_cache=torch.zeros(8, PAGE, hkv, dk),
                v_cache=torch.zeros(8, PAGE, hkv, dv),
                query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
                seq_lens=torch.tensor([2, 1], dtype=torch.int32),
                block_table=torch.zeros(r, 2, dtype=torch.int32),
                slot_mapping=torch.full((n,), -1, dtype=torch.int64), scale=0.3,
                picks=torch.full((n, 5), -1, dtype=torch.int64))


@pytest.mark.parametrize("name, bad, match", [
    ("picks", torch.zeros(3, 5), "picks is torch.float32"),
    ("picks", torch.zeros(2, 5, dtype=torch.int64), r"picks is torch.int64 \(2, 5\)"),
    ("k_cache", torch.zeros(8, PAGE, 2, 16), "k_cache .* head dim 24"),
    ("k_cache", torch.zeros(8, PAGE, 3, 24), "k .* must be"),
    ("v_cache", torch.zeros(8, PAGE, 2, 16, dtype=torch.bfloat16), "v_cache .* must match"),
    ("slot_mapping", torch.zeros(2, dtype=torch.int64), "slot_mapping .* N"),
    ("block_table", torch.zeros(2, 2), "block_table is torch.float32"),
    ("v_cache", torch.zeros(8, PAGE, 16, 2).transpose(2, 3), "the KV pools must be contiguous"),
    ("sinks", torch.zeros(3), "sinks is torch.float32 of shape \\(3,\\)"),
    ("picks", torch.zeros(3, 3, 5, dtype=torch.int64), "Hp dividing the 4 query heads"),
    ("pick_block", 0, "pick_block=0"),
], ids=["picks_float", "picks_rows", "k_cache_dim", "k_cache_heads", "v_cache_dtype",
        "slot_mapping_len", "block_table_float", "v_cache_strided", "sinks_shape", "pick_heads",
        "pick_block"])
def test_triton_sparse_attention_refuses_by_name(name, bad, match):
    args = {**_attention_args(), name: bad}
    with pytest.raises(ValueError, match=f"sparse_attention_triton: .*{match}"):
        sparse_attention_triton(**args)


@pytest.mark.parametrize("name, bad, match", [
    ("topk", 0, "topk=0"),
    ("k", torch.zeros(3, 6), "k is"),
    ("key_pool", torch.zeros(8, PAGE, 16), "key_pool is"),
    ("slot_mapping", torch.zeros(4, dtype=torch.int64), "slot_mapping .* N"),
    ("key_pool", torch.zeros(8, 8, PAGE).transpose(1, 2), "key_pool is on .*not contiguous"),
], ids=["topk", "k_shape", "key_pool_dim", "slot_mapping_len", "key_pool_strided"])
def test_triton_sparse_index_refuses_by_name(name, bad, match):
    args = dict(q=torch.zeros(3, 4, 8), weights=torch.zeros(3, 4), k=torch.zeros(3, 8),
                key_pool=torch.zeros(8, PAGE, 8),
                query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                seq_lens=torch.tensor([3], dtype=torch.int32),
                block_table=torch.zeros(1, 2, dtype=torch.int32),
                slot_mapping=torch.full((3,), -1, dtype=torch.int64), topk=4,
                softmax_scale=0.1)
    args[name] = bad
    with pytest.raises(ValueError, match=f"sparse_index_triton: .*{match}"):
        sparse_index_triton(**args)


def test_sparse_ops_lower_to_triton_with_the_reference_arguments():
    """``lower`` swaps the target and keeps the reference call's arguments: the Triton ops
    take the same arguments, in order, and mutate the same pools."""
    from dspark_compile.kernels.ops import LOWERED

    ops = torch.ops.dspark
    for ref, lowered in ((ops.sparse_attention, ops.sparse_attention_triton),
                         (ops.sparse_index, ops.sparse_index_triton),
                         (ops.block_index, ops.block_index_triton)):
        assert LOWERED["triton"][ref] is lowered
        a, b = ref.default._schema, lowered.default._schema
        assert [(x.name, str(x.type), x.alias_info is not None and x.alias_info.is_write)
                for x in a.arguments] == \
            [(x.name, str(x.type), x.alias_info is not None and x.alias_info.is_write)
             for x in b.arguments]
