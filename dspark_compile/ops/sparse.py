"""Sparse-attention ops (DeepSeek Sparse Attention: DeepSeek-V3.2 and the models derived from
it): schema, fake and reference.

Two ragged ops and the dense forms a capture emits (``frontend/sparse.py``); the
``ragged_attention`` pass rewrites each dense one to its ragged twin::

    dense_sparse_index(q [bs, T, Hi, Di], weights [bs, T, Hi], k [bs, T, Di], key_pool,
                       block_table, context_lens, topk, softmax_scale) -> int64 [bs, T, topk]
    sparse_index(q [N, Hi, Di], weights [N, Hi], k [N, Di], key_pool, query_start_loc,
                 seq_lens, block_table, slot_mapping, topk, softmax_scale) -> int64 [N, topk]
        writes the step's indexer keys, then picks each query's keys
    dense_sparse_attention(<dense_cached_attention's first eight arguments>,
                           picks [bs, T, (Hp,) P], sinks [H] | None, pick_block)
                           -> [bs, T, H, Dv]
    sparse_attention(<ragged_attention's first ten arguments>, picks [N, (Hp,) P],
                     sinks [H] | None, pick_block) -> [N, H, Dv]
    dense_block_index(q [bs, T, Hi, Di], k [bs, T, Di], key_pool, block_table, context_lens,
                      block_size, topk, local) -> int64 [bs, T, Hi, topk]
    block_index(q [N, Hi, Di], k [N, Di], key_pool, query_start_loc, seq_lens, block_table,
                slot_mapping, block_size, topk, local) -> int64 [N, Hi, topk]
        writes the step's indexer keys, then picks each query's key blocks per indexer head
        (MiniMax-M3's block-sparse layers; ``sparse_attention`` reads them with
        ``pick_block = block_size``)

Semantics and the state layout: :mod:`.sparse_reference`. The fakes check every shape and
raise ``ValueError`` naming the argument and the rule.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import sparse_reference as reference
from .attention_reference import check_semantics
from .compressed_reference import dense_layout

__all__ = ["sparse_index", "dense_sparse_index", "sparse_attention", "dense_sparse_attention",
           "block_index", "dense_block_index", "SPARSE_RAGGED_OPS", "SPARSE_DENSE_OPS"]


@torch.library.custom_op("dspark::sparse_index", mutates_args=("key_pool",))
def sparse_index(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                 key_pool: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                 topk: int, softmax_scale: float) -> torch.Tensor:
    """The indexer's picks per packed query: int64 ``[N, topk]`` (-1: none)."""
    return reference.sparse_index(q, weights, k, key_pool, query_start_loc, seq_lens,
                                  block_table, slot_mapping, topk, softmax_scale)


@sparse_index.register_fake
def _(q, weights, k, key_pool, query_start_loc, seq_lens, block_table, slot_mapping, topk,
      softmax_scale):
    reference.check_sparse_index("sparse_index", q, weights, k, key_pool, topk, 1)
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


@torch.library.custom_op("dspark::dense_sparse_index", mutates_args=("key_pool",))
def dense_sparse_index(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                       key_pool: torch.Tensor, block_table: torch.Tensor,
                       context_lens: torch.Tensor, topk: int,
                       softmax_scale: float) -> torch.Tensor:
    """Dense indexer picks: ``q [bs, T, Hi, Di] -> int64 [bs, T, topk]``."""
    reference.check_sparse_index("dense_sparse_index", q, weights, k, key_pool, topk, 2)
    bs, t, heads, dim = q.shape
    qsl, lens, slots = dense_layout(bs, t, context_lens, block_table, key_pool.shape[1],
                                    q.device)
    out = reference.sparse_index(q.reshape(bs * t, heads, dim), weights.reshape(bs * t, heads),
                                 k.reshape(bs * t, dim), key_pool, qsl, lens, block_table,
                                 slots, topk, softmax_scale)
    return out.view(bs, t, topk)


@dense_sparse_index.register_fake
def _(q, weights, k, key_pool, block_table, context_lens, topk, softmax_scale):
    reference.check_sparse_index("dense_sparse_index", q, weights, k, key_pool, topk, 2)
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int64)


@torch.library.custom_op("dspark::sparse_attention", mutates_args=("k_cache", "v_cache"))
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float, picks: torch.Tensor,
                     sinks: Optional[torch.Tensor] = None, pick_block: int = 1) -> torch.Tensor:
    """Packed attention over each query's picked keys (blocks): ``[N, H, Dv]``."""
    return reference.sparse_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_table, slot_mapping, scale, picks, sinks,
                                      pick_block)


@sparse_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      picks, sinks=None, pick_block=1):
    reference.check_picks("sparse_attention", q.shape, picks, pick_block)
    check_semantics("sparse_attention", 0, 0.0, sinks, q.shape[1])
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


def _check_dense_picks(op: str, q, picks, pick_block) -> None:
    """Dense picks ``[bs, T, (Hp,) P]`` against q ``[bs, H, T, Dk]``."""
    bs, heads, t, _ = q.shape
    if picks.dim() < 3 or tuple(picks.shape[:2]) != (bs, t):
        raise ValueError(f"{op}: picks is {tuple(picks.shape)}; it must be [bs, T, P] or "
                         f"[bs, T, Hp, P] with q's (bs, T) = {(bs, t)}")
    reference.check_picks(op, (bs * t, heads), picks.flatten(0, 1), pick_block)


@torch.library.custom_op("dspark::dense_sparse_attention", mutates_args=("k_cache", "v_cache"))
def dense_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           picks: torch.Tensor, sinks: Optional[torch.Tensor] = None,
                           pick_block: int = 1) -> torch.Tensor:
    """Dense form: q ``[bs, H, T, Dk]``, k/v ``[bs, Hkv, T, D]``, picks ``[bs, T, (Hp,) P]``
    -> ``[bs, T, H, Dv]``."""
    bs, heads, t, d = q.shape
    _check_dense_picks("dense_sparse_attention", q, picks, pick_block)
    qsl, lens, slots = dense_layout(bs, t, context_lens, block_table, k_cache.shape[1],
                                    q.device)
    dv = v.shape[3]
    out = reference.sparse_attention(
        q.transpose(1, 2).reshape(bs * t, heads, d),
        k.transpose(1, 2).reshape(bs * t, k.shape[1], d),
        v.transpose(1, 2).reshape(bs * t, v.shape[1], dv), k_cache, v_cache, qsl, lens,
        block_table, slots, scale, picks.flatten(0, 1), sinks, pick_block)
    return out.view(bs, t, heads, dv)


@dense_sparse_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, context_lens, scale, picks, sinks=None,
      pick_block=1):
    bs, heads, t, _ = q.shape
    _check_dense_picks("dense_sparse_attention", q, picks, pick_block)
    check_semantics("dense_sparse_attention", 0, 0.0, sinks, heads)
    return q.new_empty(bs, t, heads, v.shape[3])


@torch.library.custom_op("dspark::block_index", mutates_args=("key_pool",))
def block_index(q: torch.Tensor, k: torch.Tensor, key_pool: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                topk: int, local: int) -> torch.Tensor:
    """The block indexer's picks per packed query and indexer head: int64 ``[N, Hi, topk]``
    block ids (-1: none)."""
    return reference.block_index(q, k, key_pool, query_start_loc, seq_lens, block_table,
                                 slot_mapping, block_size, topk, local)


@block_index.register_fake
def _(q, k, key_pool, query_start_loc, seq_lens, block_table, slot_mapping, block_size, topk,
      local):
    reference.check_block_index("block_index", q, k, key_pool, block_size, topk, local, 1)
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int64)


@torch.library.custom_op("dspark::dense_block_index", mutates_args=("key_pool",))
def dense_block_index(q: torch.Tensor, k: torch.Tensor, key_pool: torch.Tensor,
                      block_table: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                      topk: int, local: int) -> torch.Tensor:
    """Dense block picks: ``q [bs, T, Hi, Di] -> int64 [bs, T, Hi, topk]``."""
    reference.check_block_index("dense_block_index", q, k, key_pool, block_size, topk, local,
                                2)
    bs, t, heads, dim = q.shape
    qsl, lens, slots = dense_layout(bs, t, context_lens, block_table, key_pool.shape[1],
                                    q.device)
    out = reference.block_index(q.reshape(bs * t, heads, dim), k.reshape(bs * t, dim),
                                key_pool, qsl, lens, block_table, slots, block_size, topk,
                                local)
    return out.view(bs, t, heads, topk)


@dense_block_index.register_fake
def _(q, k, key_pool, block_table, context_lens, block_size, topk, local):
    reference.check_block_index("dense_block_index", q, k, key_pool, block_size, topk, local,
                                2)
    return q.new_empty(*q.shape[:3], topk, dtype=torch.int64)


SPARSE_RAGGED_OPS = (torch.ops.dspark.sparse_index, torch.ops.dspark.sparse_attention,
                     torch.ops.dspark.block_index)
"""Op packets of the ragged sparse family (join ``ops.RAGGED_OPS``)."""
SPARSE_DENSE_OPS = (torch.ops.dspark.dense_sparse_index, torch.ops.dspark.dense_sparse_attention,
                    torch.ops.dspark.dense_block_index)
"""What a capture of a sparse layer emits (join ``ops.DENSE_OPS``)."""
