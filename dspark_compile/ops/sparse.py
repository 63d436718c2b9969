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
                           picks [bs, T, P], sinks [H] | None) -> [bs, T, H, Dv]
    sparse_attention(<ragged_attention's first ten arguments>, picks [N, P],
                     sinks [H] | None) -> [N, H, Dv]

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
           "SPARSE_RAGGED_OPS", "SPARSE_DENSE_OPS"]


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
                     sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed attention over each query's picked keys: ``[N, H, Dv]``."""
    return reference.sparse_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_table, slot_mapping, scale, picks, sinks)


@sparse_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      picks, sinks=None):
    reference.check_picks("sparse_attention", q, picks, tuple(q.shape[:1]))
    check_semantics("sparse_attention", 0, 0.0, sinks, q.shape[1])
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("dspark::dense_sparse_attention", mutates_args=("k_cache", "v_cache"))
def dense_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           picks: torch.Tensor,
                           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense form: q ``[bs, H, T, Dk]``, k/v ``[bs, Hkv, T, D]``, picks ``[bs, T, P]`` ->
    ``[bs, T, H, Dv]``."""
    bs, heads, t, d = q.shape
    reference.check_picks("dense_sparse_attention", q, picks, (bs, t))
    qsl, lens, slots = dense_layout(bs, t, context_lens, block_table, k_cache.shape[1],
                                    q.device)
    dv = v.shape[3]
    out = reference.sparse_attention(
        q.transpose(1, 2).reshape(bs * t, heads, d),
        k.transpose(1, 2).reshape(bs * t, k.shape[1], d),
        v.transpose(1, 2).reshape(bs * t, v.shape[1], dv), k_cache, v_cache, qsl, lens,
        block_table, slots, scale, picks.reshape(bs * t, -1), sinks)
    return out.view(bs, t, heads, dv)


@dense_sparse_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, context_lens, scale, picks, sinks=None):
    bs, heads, t, _ = q.shape
    reference.check_picks("dense_sparse_attention", q, picks, (bs, t))
    check_semantics("dense_sparse_attention", 0, 0.0, sinks, heads)
    return q.new_empty(bs, t, heads, v.shape[3])


SPARSE_RAGGED_OPS = (torch.ops.dspark.sparse_index, torch.ops.dspark.sparse_attention)
"""Op packets of the ragged sparse family (join ``ops.RAGGED_OPS``)."""
SPARSE_DENSE_OPS = (torch.ops.dspark.dense_sparse_index, torch.ops.dspark.dense_sparse_attention)
"""What a capture of a sparse layer emits (join ``ops.DENSE_OPS``)."""
