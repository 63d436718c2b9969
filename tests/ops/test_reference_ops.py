"""The dspark:: ops: torch.library.opcheck, and the reference against a naive dense oracle."""

import pytest
import torch

import dspark_compile.ops  # noqa: F401  (registers the ops)
from dspark_compile import VerifyLayout
from dspark_compile.state.pools import AttentionSpec, VerifierState


def setup(lens, ctx, heads=4, kv_heads=2, dim=8, page=4, max_context=24, seed=0):
    torch.manual_seed(seed)
    state = VerifierState.allocate([AttentionSpec(kv_heads, dim)], max_requests=len(lens) + 2,
                                   max_context=max_context, page_size=page,
                                   dtype=torch.float32, device=torch.device("cpu"))
    slots = list(range(len(lens)))[::-1]
    k_cache, v_cache = state.kv_caches[0]
    k_cache.normal_()
    v_cache.normal_()
    state.committed_lens[torch.tensor(slots)] = torch.tensor(ctx, dtype=torch.int32)
    layout = VerifyLayout.pack(lens, ctx, slots)
    n = layout.num_tokens
    q = torch.randn(n, heads, dim)
    k = torch.randn(n, kv_heads, dim)
    v = torch.randn(n, kv_heads, dim)
    meta = (layout.query_start_loc, layout.seq_lens,
            state.block_table[layout.slots.long()], state.slot_mapping(layout))
    return state, layout, (q, k, v, k_cache, v_cache, *meta, dim ** -0.5)


def naive(state, layout, args):
    """Attention of each request over its whole sequence, built by gathering keys token by token."""
    q, k, v, k_cache, v_cache, qsl, seq_lens, table, slot_mapping, scale = args
    page = state.page_size
    out = torch.empty_like(q)
    for i in range(layout.num_requests):
        s, e = int(qsl[i]), int(qsl[i + 1])
        ctx = int(seq_lens[i]) - (e - s)
        rows = [int(table[i, p // page]) * page + p % page for p in range(ctx)]
        keys = torch.cat([k_cache.flatten(0, 1)[rows], k[s:e]])
        vals = torch.cat([v_cache.flatten(0, 1)[rows], v[s:e]])
        group = q.shape[1] // k.shape[1]
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], keys) * scale
        mask = torch.arange(ctx + e - s)[None, :] <= (ctx + torch.arange(e - s))[:, None]
        scores = scores.masked_fill(~mask, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
    return out


@pytest.mark.parametrize("lens, ctx", [([1], [0]), ([3, 1, 5], [0, 7, 9]), ([2, 2], [4, 11])])
def test_ragged_reference_matches_naive(lens, ctx):
    state, layout, args = setup(lens, ctx)
    want = naive(state, layout, args)
    got = torch.ops.dspark.ragged_attention(*args)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The new K/V landed where slot_mapping says.
    k_cache, slot_mapping = args[3], args[8]
    assert torch.equal(k_cache.flatten(0, 1)[slot_mapping], args[1])


def test_padding_rows_write_nothing_and_come_out_zero():
    state, layout, args = setup([2, 3], [1, 0])
    q, k, v, k_cache, v_cache, qsl, seq_lens, table, slot_mapping, scale = args
    pad = 3
    q = torch.cat([q, torch.full((pad, *q.shape[1:]), float("nan"))])
    k = torch.cat([k, torch.full((pad, *k.shape[1:]), float("nan"))])
    v = torch.cat([v, torch.full((pad, *v.shape[1:]), float("nan"))])
    slot_mapping = torch.cat([slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    before = k_cache.clone()
    out = torch.ops.dspark.ragged_attention(q, k, v, k_cache, v_cache, qsl, seq_lens, table,
                                            slot_mapping, scale)
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    assert torch.isfinite(out).all() and torch.isfinite(k_cache).all()
    changed = (k_cache != before).any(-1).any(-1).flatten().nonzero().flatten()
    assert set(changed.tolist()) <= set(slot_mapping[:-pad].tolist())


def test_nan_in_unseen_pool_rows_cannot_reach_outputs():
    state, layout, args = setup([3, 2], [5, 2])
    clean = torch.ops.dspark.ragged_attention(*[a.clone() if isinstance(a, torch.Tensor) else a
                                                for a in args])
    k_cache, v_cache, slot_mapping = args[3], args[4], args[8]
    seen = set(slot_mapping.tolist())
    page = state.page_size
    for i, slot in enumerate(layout.slots.tolist()):
        table = state.block_table[slot]
        seen |= {int(table[p // page]) * page + p % page
                 for p in range(int(layout.context_lens[i]))}
    unseen = torch.tensor(sorted(set(range(k_cache.shape[0] * page)) - seen))
    k_cache.flatten(0, 1)[unseen] = float("nan")
    v_cache.flatten(0, 1)[unseen] = float("inf")
    got = torch.ops.dspark.ragged_attention(*args)
    assert torch.equal(got, clean)


def test_dense_op_equals_ragged_op_on_uniform_layout():
    state, layout, args = setup([3, 3], [2, 6])
    q, k, v, k_cache, v_cache, qsl, seq_lens, table, slot_mapping, scale = args
    bs, t = 2, 3
    dense_q = q.view(bs, t, *q.shape[1:]).transpose(1, 2)
    dense_k = k.view(bs, t, *k.shape[1:]).transpose(1, 2)
    dense_v = v.view(bs, t, *v.shape[1:]).transpose(1, 2)
    k2, v2 = k_cache.clone(), v_cache.clone()
    ragged = torch.ops.dspark.ragged_attention(*args)
    dense = torch.ops.dspark.dense_cached_attention(dense_q, dense_k, dense_v, k2, v2, table,
                                                    layout.context_lens, scale)
    assert torch.equal(dense.reshape(bs * t, *q.shape[1:]), ragged)
    assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


def test_opcheck_ragged_attention():
    _, _, args = setup([3, 1], [2, 5])
    torch.library.opcheck(torch.ops.dspark.ragged_attention.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


def test_opcheck_dense_cached_attention():
    state, layout, args = setup([2, 2], [3, 1])
    q, k, v, k_cache, v_cache, qsl, seq_lens, table, slot_mapping, scale = args
    dense = (q.view(2, 2, *q.shape[1:]).transpose(1, 2).contiguous(),
             k.view(2, 2, *k.shape[1:]).transpose(1, 2).contiguous(),
             v.view(2, 2, *v.shape[1:]).transpose(1, 2).contiguous(),
             k_cache, v_cache, table, layout.context_lens, scale)
    torch.library.opcheck(torch.ops.dspark.dense_cached_attention.default, dense,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))
