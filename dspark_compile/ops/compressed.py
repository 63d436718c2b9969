"""Compressed-attention ops (DeepSeek-V4's HCA and CSA layers): schema, fake and reference.

Three ragged ops and the dense forms a capture emits (``frontend/compressed.py``); the
``ragged_attention`` pass rewrites each dense one to its ragged twin::

    dense_compress(kv [bs, T, W], gate, kv_pool, gate_pool, entry_pool, block_table,
                   context_lens, position_bias, norm_weight, inv_freq, rate, overlap, eps,
                   rope_scale) -> [bs, T, D]
    compress(kv [N, W], gate, kv_pool, gate_pool, entry_pool, query_start_loc, seq_lens,
             block_table, slot_mapping, ...same...) -> [N, D]
        writes the raw rows and the entries of the windows that close in the step
    dense_index_topk(q [bs, T, Hi, Di], weights [bs, T, Hi], entry_pool, fresh [bs, T, Di],
                     block_table, context_lens, rate, topk, softmax_scale) -> int64 [bs, T, k]
    index_topk(q [N, Hi, Di], weights [N, Hi], entry_pool, fresh [N, Di], query_start_loc,
               seq_lens, block_table, rate, topk, softmax_scale) -> int64 [N, k]
    dense_compressed_attention(<dense_cached_attention's arguments>, entries, fresh [bs, T, D],
                               rate, topk [bs, T, k] | None) -> [bs, T, H, Dv]
    compressed_attention(<ragged_attention's arguments>, entries, fresh [N, D], rate,
                         topk [N, k] | None) -> [N, H, Dv]

Semantics and the state layout: :mod:`.compressed_reference`. The ops that write pools mutate
them in place (``mutates_args``); a reader takes the writer's returned rows (``fresh``) so that
no schedule can move the read before the write. The fakes check every shape and switch and
raise ``ValueError`` naming the argument and the rule.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import compressed_reference as reference
from .attention_reference import check_semantics

__all__ = ["compress", "dense_compress", "index_topk", "dense_index_topk",
           "compressed_attention", "dense_compressed_attention", "COMPRESSED_RAGGED_OPS",
           "COMPRESSED_DENSE_OPS"]


# ---------------------------------------------------------------------------- compress
@torch.library.custom_op("dspark::compress",
                         mutates_args=("kv_pool", "gate_pool", "entry_pool"))
def compress(kv: torch.Tensor, gate: torch.Tensor, kv_pool: torch.Tensor,
             gate_pool: torch.Tensor, entry_pool: torch.Tensor,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, position_bias: torch.Tensor,
             norm_weight: torch.Tensor, inv_freq: torch.Tensor, rate: int, overlap: bool,
             eps: float, rope_scale: float, raw_block_table: Optional[torch.Tensor] = None,
             raw_slot_mapping: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed compressor step: raw rows in, entries of closing windows written; ``[N, D]``.
    ``raw_block_table`` / ``raw_slot_mapping``: the raw rows' ring (None: the pools' own)."""
    return reference.compress(kv, gate, kv_pool, gate_pool, entry_pool, query_start_loc,
                              seq_lens, block_table, slot_mapping, position_bias, norm_weight,
                              inv_freq, rate, overlap, eps, rope_scale, raw_block_table,
                              raw_slot_mapping)


@compress.register_fake
def _(kv, gate, kv_pool, gate_pool, entry_pool, query_start_loc, seq_lens, block_table,
      slot_mapping, position_bias, norm_weight, inv_freq, rate, overlap, eps, rope_scale,
      raw_block_table=None, raw_slot_mapping=None):
    reference.check_compress("compress", kv, gate, kv_pool, gate_pool, entry_pool,
                             position_bias, norm_weight, inv_freq, rate, overlap, 2)
    reference.check_raw_layout("compress", block_table, slot_mapping, raw_block_table,
                               raw_slot_mapping)
    return kv.new_empty(kv.shape[0], entry_pool.shape[-1])


@torch.library.custom_op("dspark::dense_compress",
                         mutates_args=("kv_pool", "gate_pool", "entry_pool"))
def dense_compress(kv: torch.Tensor, gate: torch.Tensor, kv_pool: torch.Tensor,
                   gate_pool: torch.Tensor, entry_pool: torch.Tensor,
                   block_table: torch.Tensor, context_lens: torch.Tensor,
                   position_bias: torch.Tensor, norm_weight: torch.Tensor,
                   inv_freq: torch.Tensor, rate: int, overlap: bool, eps: float,
                   rope_scale: float) -> torch.Tensor:
    """Dense compressor step: ``bs`` requests of ``T`` tokens at ``context_lens``; defined as
    :func:`compress` on that layout. ``[bs, T, W] -> [bs, T, D]``."""
    bs, t, width = kv.shape
    qsl, lens, slots = reference.dense_layout(bs, t, context_lens, block_table,
                                              kv_pool.shape[1], kv.device)
    out = reference.compress(kv.reshape(bs * t, width), gate.reshape(bs * t, width), kv_pool,
                             gate_pool, entry_pool, qsl, lens, block_table, slots,
                             position_bias, norm_weight, inv_freq, rate, overlap, eps,
                             rope_scale)
    return out.view(bs, t, -1)


@dense_compress.register_fake
def _(kv, gate, kv_pool, gate_pool, entry_pool, block_table, context_lens, position_bias,
      norm_weight, inv_freq, rate, overlap, eps, rope_scale):
    reference.check_compress("dense_compress", kv, gate, kv_pool, gate_pool, entry_pool,
                             position_bias, norm_weight, inv_freq, rate, overlap, 3)
    return kv.new_empty(kv.shape[0], kv.shape[1], entry_pool.shape[-1])


# ---------------------------------------------------------------------------- indexer
@torch.library.custom_op("dspark::index_topk", mutates_args=())
def index_topk(q: torch.Tensor, weights: torch.Tensor, entry_pool: torch.Tensor,
               fresh: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, rate: int, topk: int,
               softmax_scale: float) -> torch.Tensor:
    """CSA's indexer picks per packed query: int64 ``[N, topk]`` (-1: none)."""
    return reference.index_topk(q, weights, entry_pool, fresh, query_start_loc, seq_lens,
                                block_table, rate, topk, softmax_scale)


@index_topk.register_fake
def _(q, weights, entry_pool, fresh, query_start_loc, seq_lens, block_table, rate, topk,
      softmax_scale):
    reference.check_index("index_topk", q, weights, entry_pool, fresh, rate, topk, 1)
    return q.new_empty(q.shape[0], topk, dtype=torch.int64)


@torch.library.custom_op("dspark::dense_index_topk", mutates_args=())
def dense_index_topk(q: torch.Tensor, weights: torch.Tensor, entry_pool: torch.Tensor,
                     fresh: torch.Tensor, block_table: torch.Tensor,
                     context_lens: torch.Tensor, rate: int, topk: int,
                     softmax_scale: float) -> torch.Tensor:
    """Dense indexer picks: ``q [bs, T, Hi, Di] -> int64 [bs, T, topk]``."""
    bs, t, heads, dim = q.shape
    qsl, lens, _ = reference.dense_layout(bs, t, context_lens, block_table,
                                          entry_pool.shape[1], q.device)
    out = reference.index_topk(q.reshape(bs * t, heads, dim), weights.reshape(bs * t, heads),
                               entry_pool, fresh.reshape(bs * t, dim), qsl, lens, block_table,
                               rate, topk, softmax_scale)
    return out.view(bs, t, topk)


@dense_index_topk.register_fake
def _(q, weights, entry_pool, fresh, block_table, context_lens, rate, topk, softmax_scale):
    reference.check_index("dense_index_topk", q, weights, entry_pool, fresh, rate, topk, 2)
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int64)


# ---------------------------------------------------------------------------- attention
@torch.library.custom_op("dspark::compressed_attention", mutates_args=("k_cache", "v_cache"))
def compressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                         window: int, softcap: float, sinks: Optional[torch.Tensor],
                         entries: torch.Tensor, fresh: torch.Tensor, rate: int,
                         topk: Optional[torch.Tensor] = None,
                         entry_block_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed attention over the window's KV and the compressed entries: ``[N, H, Dv]``.
    ``entry_block_table``: the entries' own table (None: ``block_table``)."""
    return reference.compressed_attention(q, k, v, k_cache, v_cache, query_start_loc,
                                          seq_lens, block_table, slot_mapping, scale, window,
                                          softcap, sinks, entries, fresh, rate, topk,
                                          entry_block_table)


@compressed_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      window, softcap, sinks, entries, fresh, rate, topk=None, entry_block_table=None):
    check_semantics("compressed_attention", window, softcap, sinks, q.shape[1])
    reference.check_entries("compressed_attention", q, entries, fresh, rate, topk, 1)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("dspark::dense_compressed_attention",
                         mutates_args=("k_cache", "v_cache"))
def dense_compressed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int, softcap: float,
                               sinks: Optional[torch.Tensor], entries: torch.Tensor,
                               fresh: torch.Tensor, rate: int,
                               topk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense form: q ``[bs, H, T, Dk]``, k/v ``[bs, Hkv, T, D]``, fresh ``[bs, T, D]``, topk
    ``[bs, T, k]`` -> ``[bs, T, H, Dv]``."""
    bs, heads, t, d = q.shape
    qsl, lens, slots = reference.dense_layout(bs, t, context_lens, block_table,
                                              k_cache.shape[1], q.device)
    dv = v.shape[3]
    out = reference.compressed_attention(
        q.transpose(1, 2).reshape(bs * t, heads, d),
        k.transpose(1, 2).reshape(bs * t, k.shape[1], d),
        v.transpose(1, 2).reshape(bs * t, v.shape[1], dv), k_cache, v_cache, qsl, lens,
        block_table, slots, scale, window, softcap, sinks, entries,
        fresh.reshape(bs * t, -1), rate, None if topk is None else topk.reshape(bs * t, -1))
    return out.view(bs, t, heads, dv)


@dense_compressed_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, context_lens, scale, window, softcap, sinks,
      entries, fresh, rate, topk=None):
    check_semantics("dense_compressed_attention", window, softcap, sinks, q.shape[1])
    reference.check_entries("dense_compressed_attention", q, entries, fresh, rate, topk, 2)
    bs, heads, t, _ = q.shape
    return q.new_empty(bs, t, heads, v.shape[3])


COMPRESSED_RAGGED_OPS = (torch.ops.dspark.compress, torch.ops.dspark.index_topk,
                         torch.ops.dspark.compressed_attention)
"""Op packets of the ragged compressed family (join ``ops.RAGGED_OPS``)."""
COMPRESSED_DENSE_OPS = (torch.ops.dspark.dense_compress, torch.ops.dspark.dense_index_topk,
                        torch.ops.dspark.dense_compressed_attention)
"""What a capture of a compressed layer emits (join ``ops.DENSE_OPS``)."""
