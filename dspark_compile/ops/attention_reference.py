"""Pure-torch reference implementations of the ``dspark::`` ops.

These are the CPU execution path and the oracle that every kernel is tested against. They
favour clarity over speed: a Python loop over requests is fine here.

Containment: a query reads only the keys it is allowed to see (its request's committed context
and its own block up to itself). Keys past that are never touched, so whatever a padding
position or a rejected draft holds (NaN included) cannot reach an accepted row.
"""

from __future__ import annotations

import torch

__all__ = ["kv_write", "ragged_attention", "dense_cached_attention"]


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write packed ``k, v [N, Hkv, D]`` into pool rows ``slot_mapping [N]`` (< 0: skip)."""
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    rows = slot_mapping[keep].long()
    flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [pages * page_size, Hkv, D]
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    assert flat_k.shape[0] == k_cache.shape[0] * page_size, "pool must be contiguous"
    flat_k.index_copy_(0, rows, k[keep].to(k_cache.dtype))
    flat_v.index_copy_(0, rows, v[keep].to(v_cache.dtype))


def _gather_keys(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one request's pages: ``[length, Hkv, D]``."""
    page_size = cache.shape[1]
    pages = -(-length // page_size)
    return cache[block_row[:pages].long()].flatten(0, 1)[:length]


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int,
                scale: float) -> torch.Tensor:
    """Causal attention of ``q [L, H, D]`` at positions ``context + j`` over
    ``keys [S, Hkv, D]``."""
    num_q, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    kh = keys.float().repeat_interleave(group, dim=1)  # [S, H, D]
    vh = values.float().repeat_interleave(group, dim=1)
    out = torch.empty(num_q, num_heads, q.shape[2], dtype=torch.float32, device=q.device)
    for j in range(num_q):
        visible = context + j + 1  # only keys this query may see are read at all
        scores = torch.einsum("hd,shd->hs", q[j].float(), kh[:visible]) * scale
        probs = torch.softmax(scores, dim=-1)
        out[j] = torch.einsum("hs,shd->hd", probs, vh[:visible])
    return out


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float) -> torch.Tensor:
    """Write the new K/V, then causal paged attention for packed queries.

    q ``[N, H, D]``; k, v ``[N, Hkv, D]``; pools ``[pages, page_size, Hkv, D]``;
    query_start_loc ``[R + 1]``; seq_lens ``[R]`` (context + own length); block_table
    ``[R, pages_per_request]``; slot_mapping ``[N]`` (< 0 for padding rows). Returns
    ``[N, H, D]`` in q's dtype; rows past ``query_start_loc[R]`` are zeros.
    """
    kv_write(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        context = lens[i] - (end - start)
        keys = _gather_keys(k_cache, block_table[i], lens[i])
        values = _gather_keys(v_cache, block_table[i], lens[i])
        out[start:end] = _attend_one(q[start:end], keys, values, context, scale)
    return out.to(q.dtype)


def dense_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Dense verify attention: every one of ``bs`` requests runs ``T`` tokens.

    q ``[bs, H, T, D]``, k, v ``[bs, Hkv, T, D]`` (the layout HF attention functions receive);
    returns ``[bs, T, H, D]``. Token ``t`` of request ``b`` sits at ``context_lens[b] + t``,
    writes its K/V there and attends keys ``0 .. context_lens[b] + t``. Defined as the ragged
    op on ``bs`` requests of length ``T`` so the two can never disagree.
    """
    bs, num_heads, t, d = q.shape
    page_size = k_cache.shape[1]
    lens = torch.full((bs,), t, dtype=torch.int64, device=q.device)
    qsl = torch.zeros(bs + 1, dtype=torch.int64, device=q.device)
    qsl[1:] = torch.cumsum(lens, 0)
    pos = context_lens.long().unsqueeze(1) + torch.arange(t, device=q.device)  # [bs, T]
    page = block_table.long().gather(1, pos // page_size)
    slot_mapping = (page * page_size + pos % page_size).flatten()
    out = ragged_attention(
        q.transpose(1, 2).reshape(bs * t, num_heads, d),
        k.transpose(1, 2).reshape(bs * t, k.shape[1], d),
        v.transpose(1, 2).reshape(bs * t, v.shape[1], d),
        k_cache, v_cache, qsl, context_lens.long() + t, block_table, slot_mapping, scale,
    )
    return out.view(bs, t, num_heads, d)
