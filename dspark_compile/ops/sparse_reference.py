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

Block picks (MiniMax-M3's block-sparse layers, ``MiniMaxM3VLIndexer``): ``block_index`` writes
the step's keys into the same kind of key pool, then for each query (position ``p``) and
indexer head ``h`` scores every key it may see, ``q[t, h] . key[s]`` in float32 for ``s <= p``,
max-pools the scores into blocks of ``block_size`` positions (block ``b`` holds positions
``b * block_size ..``), gives the ``local`` blocks ending at ``p``'s own block a score of +inf
(they are always kept) and keeps the ``topk`` best blocks: int64 ``[N, Hi, topk]`` block ids,
-1 where fewer blocks exist. ``sparse_attention`` reads such picks with ``pick_block =
block_size``: pick ``b`` stands for the positions of block ``b`` up to ``p``, and picks with a
head axis ``[N, Hp, P]`` give query head ``h`` the row ``h // (H / Hp)`` (HF's block mask
repeats each indexer head over ``H / Hi`` query heads).
"""

from __future__ import annotations

import torch

from typing import Optional

from .attention_reference import _gather_keys, check_semantics, kv_write
from .compressed_reference import index_topk

__all__ = ["sparse_index", "sparse_attention", "block_index", "check_sparse_index",
           "check_block_index", "check_picks", "store_rows"]


def _check_keys(op: str, q, k, key_pool) -> None:
    """One indexer key per query row, and a key pool ``[pages, page_size, Di]``."""
    if tuple(k.shape) != (*q.shape[:-2], q.shape[-1]):
        raise ValueError(f"{op}: k is {tuple(k.shape)}; it must be one indexer key per row "
                         f"{(*q.shape[:-2], q.shape[-1])}")
    if key_pool.dim() != 3 or key_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"{op}: key_pool is {tuple(key_pool.shape)}; it must be [pages, "
                         f"page_size, Di] = [.., .., {q.shape[-1]}]")


def check_sparse_index(op: str, q, weights, k, key_pool, topk, rows_dim: int) -> None:
    """The indexer's arguments (q rows first: ``rows_dim`` row axes); raise ``ValueError``
    naming the argument and the rule."""
    if type(topk) is not int or topk < 1:
        raise ValueError(f"{op}: topk={topk!r}; it must be an int >= 1 (keys per query)")
    if q.dim() != rows_dim + 2 or tuple(weights.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"{op}: q {tuple(q.shape)}, weights {tuple(weights.shape)}; q must be "
                         "[rows, Hi, Di] (dense: [bs, T, Hi, Di]) and weights q's shape "
                         "without Di")
    _check_keys(op, q, k, key_pool)


def check_block_index(op: str, q, k, key_pool, block_size, topk, local,
                      rows_dim: int) -> None:
    """The block indexer's arguments (q rows first: ``rows_dim`` row axes); raise
    ``ValueError`` naming the argument and the rule."""
    for name, value in (("block_size", block_size), ("topk", topk)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{op}: {name}={value!r}; it must be an int >= 1")
    if type(local) is not int or not 0 <= local <= topk:
        raise ValueError(f"{op}: local={local!r}; it must be an int in 0 .. topk={topk} (the "
                         "always-kept blocks must all fit in the picks, or which of them are "
                         "kept would be a tie)")
    if q.dim() != rows_dim + 2:
        raise ValueError(f"{op}: q is {tuple(q.shape)}; it must be [rows, Hi, Di] (dense: "
                         "[bs, T, Hi, Di])")
    _check_keys(op, q, k, key_pool)


def check_picks(op: str, q_shape, picks, pick_block: int = 1) -> None:
    """``picks``: integer ``[N, P]`` or ``[N, Hp, P]`` (the rows of q ``[N, H, ...]``, its
    shape ``q_shape``; ``Hp`` dividing its heads), positions or -1; ``pick_block``: an int >= 1
    (positions a pick stands for)."""
    rows, heads = tuple(q_shape[:1]), q_shape[1]
    ok = not picks.is_floating_point() and picks.dim() in (2, 3) \
        and tuple(picks.shape[:1]) == rows
    if ok and picks.dim() == 3:
        hp = picks.shape[1]
        ok = hp >= 1 and heads % hp == 0
    if not ok:
        raise ValueError(f"{op}: picks is {picks.dtype} {tuple(picks.shape)}; it must be integer "
                         f"{(*rows, 'P')} or {(*rows, 'Hp', 'P')} with Hp dividing the "
                         f"{heads} query heads: each query's key positions (blocks), -1 for "
                         "none")
    if type(pick_block) is not int or pick_block < 1:
        raise ValueError(f"{op}: pick_block={pick_block!r}; it must be an int >= 1 (key "
                         "positions one pick stands for)")


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
                     sinks: Optional[torch.Tensor] = None,
                     pick_block: int = 1) -> torch.Tensor:
    """``attention_reference.ragged_attention``'s arguments (no window or softcap) and
    ``picks [N, P]`` or ``[N, Hp, P]``: each query (head) attends to the keys at its picks, a
    pick standing for ``pick_block`` positions (module docstring); ``sinks`` ``[H]``: one more
    logit per head in the softmax denominator, as in ``ragged_attention``. Returns
    ``[N, H, Dv]`` in q's dtype; rows past ``query_start_loc[R]`` are zeros."""
    check_picks("sparse_attention", q.shape, picks, pick_block)
    check_semantics("sparse_attention", 0, 0.0, sinks, q.shape[1])
    kv_write(k, v, k_cache, v_cache, slot_mapping)
    heads = q.shape[1]
    group = heads // k_cache.shape[2]
    out = torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    rows = picks[:, None, :] if picks.dim() == 2 else picks  # [N, Hp, P]
    span = heads // rows.shape[1]  # query heads a pick row serves
    offsets = torch.arange(pick_block, device=q.device)
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
            for g in range(rows.shape[1]):
                hs = slice(g * span, (g + 1) * span)
                row = rows[start + j, g].long()
                row = row[row >= 0]
                row = (row[:, None] * pick_block + offsets[None]).flatten()
                row = row[row <= context + j]
                if row.numel() == 0:
                    continue
                scores = torch.einsum("hd,shd->hs", q[start + j, hs].float(),
                                      keys[row, hs]) * scale
                if sinks is not None:  # one more logit per head in the denominator, dropped
                    logits = torch.cat([scores, sinks.float()[hs, None]], dim=1)
                    probs = torch.softmax(logits, dim=-1)[:, :-1]
                else:
                    probs = torch.softmax(scores, dim=-1)
                out[start + j, hs] = torch.einsum("hs,shd->hd", probs, values[row, hs])
    return out.to(q.dtype)


def block_index(q: torch.Tensor, k: torch.Tensor, key_pool: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                topk: int, local: int) -> torch.Tensor:
    """Write ``k [N, Di]`` at ``slot_mapping``, then each query's blocks: ``q [N, Hi, Di]``
    (normed and rotated) -> int64 ``[N, Hi, topk]`` block ids, -1 for none (module
    docstring). Equal block scores are resolved as HF's indexer resolves them over the same
    sequence: its op shapes, ``torch.topk`` with ``k = min(topk, blocks of the request)``."""
    check_block_index("block_index", q, k, key_pool, block_size, topk, local, 1)
    store_rows(k, key_pool, slot_mapping)
    n, heads, _ = q.shape
    out = torch.full((n, heads, topk), -1, dtype=torch.int64, device=q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i in range(len(qsl) - 1):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        length = end - start
        context = lens[i] - length
        blocks = -(-lens[i] // block_size)
        keys = _gather_keys(key_pool, block_table[i], 0, lens[i])  # [S, Di]
        # HF's scorer: [Hi, L, Di] @ [Di, S] -> [Hi, L, S], future keys -inf, padded to blocks
        scores = torch.matmul(q[start:end].float().transpose(0, 1), keys.float().t())
        pos = context + torch.arange(length, device=q.device)
        future = torch.arange(lens[i], device=q.device)[None, :] > pos[:, None]  # [L, S]
        scores = scores.masked_fill(future[None], float("-inf"))
        scores = torch.nn.functional.pad(scores, (0, blocks * block_size - lens[i]),
                                         value=float("-inf"))
        block_scores = scores.view(heads, length, blocks, block_size).amax(dim=-1)
        if local:
            own = (pos // block_size)[:, None] - torch.arange(local, device=q.device)[None]
            own = own.clamp(min=0)[None].expand(heads, -1, -1)
            block_scores.scatter_(-1, own, float("inf"))
        kept = min(topk, blocks)
        best, ids = block_scores.topk(kept, dim=-1)  # [Hi, L, kept]
        ids = ids.masked_fill(best == float("-inf"), -1)
        out[start:end, :, :kept] = ids.transpose(0, 1)
    return out
