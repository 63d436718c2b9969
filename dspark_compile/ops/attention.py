"""Cached attention ops: ``dspark::ragged_attention`` (the packed form) and
``dspark::dense_cached_attention`` (what a dense capture emits); schema, fake and reference.

Each op is a ``torch.library`` custom op so that it shows up as one node in a captured graph,
carries shapes through fake tensors, and mutates the KV pool in place (``mutates_args``):
slice assignment into a cache inside a compiled graph is functionalized into copies of the
whole cache, which is why KV writes are ops of their own.
"""

from __future__ import annotations

import torch

from . import attention_reference as reference

__all__ = ["ragged_attention", "dense_cached_attention"]


@torch.library.custom_op("dspark::ragged_attention", mutates_args=("k_cache", "v_cache"))
def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float) -> torch.Tensor:
    """Packed causal paged attention. q ``[N, H, D]``, k/v ``[N, Hkv, D]`` -> ``[N, H, D]``."""
    return reference.ragged_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_table, slot_mapping, scale)


@ragged_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale):
    return torch.empty_like(q)


@torch.library.custom_op("dspark::dense_cached_attention", mutates_args=("k_cache", "v_cache"))
def dense_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Dense verify attention over the paged pool. q ``[bs, H, T, D]`` -> ``[bs, T, H, D]``."""
    return reference.dense_cached_attention(q, k, v, k_cache, v_cache, block_table,
                                            context_lens, scale)


@dense_cached_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, context_lens, scale):
    bs, num_heads, t, d = q.shape
    return q.new_empty(bs, t, num_heads, d)
