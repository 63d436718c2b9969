"""Pure-torch references of the sparse-attention ops (DeepSeek Sparse Attention, DSA: the
lightning indexer picks, per query, the ``topk`` keys its attention may read).

A DSA layer keeps, besides its KV, one indexer key per token: ``key_pool [pages, page_size,
Di]``, token ``p``'s key at position ``p`` through the block table (the KV pool's slot mapping).
Like KV, it needs no commit or rollback: the committed length says which rows are valid and a
step rewrites whatever lies past it.

``sparse_index`` (Hugging Face's ``DeepseekV32Indexer`` and the indexers derived from it,
transformers 5.24) writes the step's keys, then scores every key a query at position ``p`` may
see (positions ``0 .. p``)::

    score[t, s] = sum_h weights[t, h] * relu(q[t, h] . key[s]) * softmax_scale

and keeps the ``min(topk, p + 1)`` best positions (the rest of the row is -1). It is
:func:`compressed_reference.index_topk` with one entry per token (``rate`` 1): equal scores are
resolved as HF's indexer resolves them over the same sequence.

``sparse_attention`` writes the step's K/V, then each query attends to the keys at its valid
(>= 0) picks only: HF's eager path, which masks every key the indexer did not pick on top of the
causal mask. Picks of one row are distinct positions ``<= p`` (the indexer makes them so); a
query with no valid pick outputs zeros (with ``sinks``, too: the sink alone takes the whole
softmax and is dropped).
"""

from __future__ import annotations

import torch

from typing import Optional

from .attention_reference import _gather_keys, check_semantics, kv_write
from .compressed_reference import index_topk

__all__ = ["sparse_index", "sparse_attention", "check_sparse_index", "check_picks",
           "store_rows"]


def check_sparse_index(op: str, q, weights, k, key_pool, topk, rows_dim: int) -> None:
    """The indexer's arguments (q rows first: ``rows_dim`` row axes); raise ``ValueError``
    naming the argument and the rule."""
    if type(topk) is not int or topk < 1:
        raise ValueError(f"{op}: topk={topk!r}; it must be an int >= 1 (keys per query)")
    if q.dim() != rows_dim + 2 or tuple(weights.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"{op}: q {tuple(q.shape)}, weights {tuple(weights.shape)}; q must be "
                         "[rows, Hi, Di] (dense: [bs, T, Hi, Di]) and weights q's shape "
                         "without Di")
    if tuple(k.shape) != (*q.shape[:-2], q.shape[-1]):
        raise ValueError(f"{op}: k is {tuple(k.shape)}; it must be one indexer key per row "
                         f"{(*q.shape[:-2], q.shape[-1])}")
    if key_pool.dim() != 3 or key_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"{op}: key_pool is {tuple(key_pool.shape)}; it must be [pages, "
                         f"page_size, Di] = [.., .., {q.shape[-1]}]")


def check_picks(op: str, q, picks, rows: tuple) -> None:
    """``picks``: integer ``[*rows, P]`` (q's rows), positions or -1."""
    if picks.is_floating_point() or picks.dim() != len(rows) + 1 \
            or tuple(picks.shape[:-1]) != tuple(rows):
        raise ValueError(f"{op}: picks is {picks.dtype} {tuple(picks.shape)}; it must be integer "
                         f"{(*rows, 'P')}: each query's key positions, -1 for none")


def store_rows(rows: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``rows [N, D]`` into ``pool [pages, page_size, D]`` at ``slot_mapping [N]`` (< 0:
    skip)."""
    keep = slot_mapping >= 0
    flat = pool.view(-1, pool.shape[-1])
    flat.index_copy_(0, slot_mapping[keep].long(), rows[keep].to(pool.dtype))


def sparse_index(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                 key_pool: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor,
                 slot_mapping: torch.Tensor, topk: int, softmax_scale: float) -> torch.Tensor:
    """Write ``k [N, Di]`` at ``slot_mapping``, then the indexer's picks: ``q [N, Hi, Di]``
    (rotated), ``weights [N, Hi]`` (float32, with every scale but ``softmax_scale`` applied)
    -> int64 ``[N, topk]`` positions (module docstring)."""
    check_sparse_index("sparse_index", q, weights, k, key_pool, topk, 1)
    store_rows(k, key_pool, slot_mapping)
    return index_topk(q, weights, key_pool, k, query_start_loc, seq_lens, block_table, 1, topk,
                      softmax_scale)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float, picks: torch.Tensor,
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``attention_reference.ragged_attention``'s arguments (no window or softcap) and
    ``picks [N, P]``: each query attends to the keys at its picks (module docstring); ``sinks``
    ``[H]``: one more logit per head in the softmax denominator, as in ``ragged_attention``.
    Returns ``[N, H, Dv]`` in q's dtype; rows past ``query_start_loc[R]`` are zeros."""
    check_picks("sparse_attention", q, picks, tuple(q.shape[:1]))
    check_semantics("sparse_attention", 0, 0.0, sinks, q.shape[1])
    kv_write(k, v, k_cache, v_cache, slot_mapping)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        context = lens[i] - (end - start)
        keys = _gather_keys(k_cache, block_table[i], 0, lens[i]).float()
        values = _gather_keys(v_cache, block_table[i], 0, lens[i]).float()
        keys = keys.repeat_interleave(group, dim=1)  # [S, H, Dk]
        values = values.repeat_interleave(group, dim=1)
        for j in range(end - start):
            row = picks[start + j].long()
            row = row[(row >= 0) & (row <= context + j)]
            if row.numel() == 0:
                continue
            scores = torch.einsum("hd,shd->hs", q[start + j].float(), keys[row]) * scale
            if sinks is not None:  # one more logit per head in the denominator, then dropped
                logits = torch.cat([scores, sinks.float()[:, None]], dim=1)
                probs = torch.softmax(logits, dim=-1)[:, :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            out[start + j] = torch.einsum("hs,shd->hd", probs, values[row])
    return out.to(q.dtype)
