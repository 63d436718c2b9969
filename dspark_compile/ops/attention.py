"""Cached attention ops: ``dspark::ragged_attention`` (the packed form) and
``dspark::dense_cached_attention`` (what a dense capture emits); schema, fake and reference.

Each op is a ``torch.library`` custom op so that it shows up as one node in a captured graph,
carries shapes through fake tensors, and mutates the KV pool in place (``mutates_args``):
slice assignment into a cache inside a compiled graph is functionalized into copies of the
whole cache, which is why KV writes are ops of their own.

Both take, after ``scale``, the per-layer switches ``window`` (sliding window, 0: none),
``softcap`` (logit softcap, 0: none), ``sinks`` (``[H]`` per-head sink logits, None: none) and
``chunk`` (chunked attention, 0: none), ``rel`` (relative logits, None: none) and ``alibi``
(ALiBi slopes, None: none),
in Hugging Face's conventions (:mod:`.attention_reference`); V's head dim may differ from
q/k's. The fakes check the switches too, so a bad one is refused while a graph is traced.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import attention_reference as reference

__all__ = ["ragged_attention", "dense_cached_attention"]


@torch.library.custom_op("dspark::ragged_attention", mutates_args=("k_cache", "v_cache"))
def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float, window: int = 0,
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                     chunk: int = 0, rel: Optional[torch.Tensor] = None,
                     alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed causal paged attention. q ``[N, H, Dk]``, k ``[N, Hkv, Dk]``, v ``[N, Hkv, Dv]``,
    rel ``[N, H, E]`` -> ``[N, H, Dv]``."""
    return reference.ragged_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_table, slot_mapping, scale, window, softcap, sinks,
                                      chunk, rel, alibi)


@ragged_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      window=0, softcap=0.0, sinks=None, chunk=0, rel=None, alibi=None):
    reference.check_semantics("ragged_attention", window, softcap, sinks, q.shape[1],
                              chunk=chunk, row_sinks=tuple(q.shape[:2]))
    reference.check_rel("ragged_attention", rel, tuple(q.shape[:2]), softcap)
    reference.check_alibi("ragged_attention", alibi, q.shape[1], softcap)
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("dspark::dense_cached_attention", mutates_args=("k_cache", "v_cache"))
def dense_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0,
                           sinks: Optional[torch.Tensor] = None,
                           chunk: int = 0, rel: Optional[torch.Tensor] = None,
                           alibi: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense verify attention over the paged pool. q ``[bs, H, T, Dk]``, v ``[bs, Hkv, T, Dv]``,
    rel ``[bs, H, T, E]`` -> ``[bs, T, H, Dv]``."""
    return reference.dense_cached_attention(q, k, v, k_cache, v_cache, block_table,
                                            context_lens, scale, window, softcap, sinks, chunk,
                                            rel, alibi)


@dense_cached_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, context_lens, scale, window=0, softcap=0.0,
      sinks=None, chunk=0, rel=None, alibi=None):
    reference.check_semantics("dense_cached_attention", window, softcap, sinks, q.shape[1],
                              chunk=chunk, row_sinks=tuple(q.shape[:3]))
    reference.check_rel("dense_cached_attention", rel, tuple(q.shape[:3]), softcap)
    reference.check_alibi("dense_cached_attention", alibi, q.shape[1], softcap)
    bs, num_heads, t, _ = q.shape
    return q.new_empty(bs, t, num_heads, v.shape[3])
