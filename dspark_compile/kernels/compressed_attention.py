"""Triton lowering of ``dspark::compressed_attention`` (DeepSeek-V4's HCA / CSA attention: one
K=V head, a sliding window, compressed entries, per-head sinks).

One launch, no host sync (it runs inside a CUDA graph); grid ``(N, cdiv(H, BLOCK_H))`` from
shapes only (:func:`plan_compressed_attention`). Program ``(t, hb)`` takes packed row ``t`` and
query heads ``hb * BLOCK_H ..``:

1. head block 0 writes the row's K and V into the paged pools at ``slot_mapping[t]`` (nothing
   for -1, so padding rows write nothing);
2. it finds its request and position ``p`` (a padding row writes zeros) and runs one online
   softmax for its heads over, in order, the sink (its logit starts the running maximum, with
   weight 1), the window's keys ``max(0, p - window + 1) .. p`` and the entries the query may
   see: every ``s < (p + 1) // rate`` (HCA) or the picks of its ``topk`` row with
   ``0 <= s < (p + 1) // rate`` (CSA). An entry is key and value. Keys below the request's
   context come from the pools through its block-table row; the step's own keys from ``k`` /
   ``v``, cast to the pool's dtype as the pool holds them, never from a pool row written in
   this launch (precondition, as for the ragged attention: row ``qsl[i] + j`` maps to position
   ``context_i + j``).

Hidden keys and entries are never loaded (masked loads give 0), so a non-finite rejected row
reaches no earlier row; one query per program, so no per-row V guard is needed. Scores and the
``P @ V`` products are ``tl.dot`` tiles in the pools' dtype (bf16 on tensor cores; P rounded to
it, as the ragged attention does), accumulated in float32; float32 operands take ``ieee`` on
every target (the float32 runs are the exactness checks against HF). Under the interpreter (CPU
tensors) every tile is made float32 first: its ``tl.dot`` of bf16 tiles is wrong (Triton 3.9).

Heads are blocked (``BLOCK_H`` = 16): one program holding all 64 of DeepSeek-V4's heads at head dim 512 kept a
``[64, 512]`` float32 accumulator and spilled it (sm_90: 29 KB of stack a thread; gfx942: 512
VGPRs and 54 spilled), where ``[16, 512]`` tiles fit (218 registers on sm_90 at 8 warps, no
stack; 222 VGPRs on gfx942, no spill; float32 tiles, the test mode, spill some: 1.5 KB of
stack on sm_90). Straightforward otherwise: a query's keys are read once
per head block, and it is not tuned.

Semantics and the oracle: ``ops/compressed_reference.compressed_attention``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention import _kv_tile, _pool_rows, _softmax_step, head_dim_pad
from .launch import launch, zeros_when_warming
from .rotary import round_to

__all__ = ["CompressedAttentionPlan", "plan_compressed_attention",
           "compressed_attention_triton"]

_LOG2E = 1.4426950408889634
_SEARCH = 32
"""``query_start_loc`` entries a program loads per step when it looks up its request."""
DOT_PRECISION = "ieee"
"""``input_precision`` of the dots on float32 operands (module docstring)."""


@triton.jit
def _row_request(query_start_loc_ptr, seq_lens_ptr, row, num_requests, SEARCH: tl.constexpr):
    """``(i, qsl[i], qsl[i + 1], seq_lens[i])`` of the request owning packed row ``row``: ``i``
    is the count of ``1 <= j <= R`` with ``qsl[j] <= row`` (empty requests are passed over);
    ``i = R``: a padding row, whose end and length are 0."""
    offs = tl.arange(0, SEARCH)
    count = 0
    for c in range(0, num_requests, SEARCH):
        j = 1 + c + offs
        start = tl.load(query_start_loc_ptr + j, mask=j <= num_requests, other=0)
        count += tl.sum(((start <= row) & (j <= num_requests)).to(tl.int32))
    req_start = tl.load(query_start_loc_ptr + count)
    live = count < num_requests
    req_end = tl.load(query_start_loc_ptr + count + 1, mask=live, other=0)
    seq_len = tl.load(seq_lens_ptr + count, mask=live, other=0)
    return count, req_start, req_end, seq_len


@triton.jit
def _new_kv_tile(k_ptr, v_ptr, cache_ty: tl.constexpr, req_start, context, pos, new, kv_head,
                 offs_d, d_mask, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head):
    """The step's own K and V ``[TILE, D_PAD]`` at positions ``pos`` (where ``new``), from the
    inputs, cast to the pool's dtype as the pool holds them."""
    rows = (req_start + pos - context).to(tl.int64)
    mask = new[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_k_tok + kv_head * stride_k_head + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + rows[:, None] * stride_v_tok + kv_head * stride_v_head + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    return round_to(k, cache_ty).to(cache_ty), round_to(v, cache_ty).to(cache_ty)


@triton.jit
def _compressed_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr,
        seq_lens_ptr, block_table_ptr, slot_mapping_ptr, sinks_ptr, entries_ptr, topk_ptr,
        entry_table_ptr, scale_log2, window, num_requests, num_picks, stride_q_tok,
        stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_out_tok, stride_out_head, stride_bt_req, stride_et_req, stride_topk_tok,
        stride_cache_row,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, NUM_HB: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
        ENTRY_PAGE_SIZE: tl.constexpr, RATE: tl.constexpr, TILE_N: tl.constexpr,
        TILE_E: tl.constexpr, SEARCH: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
        HAS_TOPK: tl.constexpr):
    """One (query row, KV head, block of its query heads): KV write (head block 0), then the
    window's keys and the visible entries in one online softmax (module docstring)."""
    row32 = tl.program_id(0)
    row = row32.to(tl.int64)
    kv_head = tl.program_id(1) // NUM_HB
    hb = tl.program_id(1) % NUM_HB
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    cache_ty = k_cache_ptr.dtype.element_ty
    # fused KV write: this row's K/V at its slot (< 0: nothing), by head block 0
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    zero_d = tl.zeros_like(offs_d)  # scalar mask terms broadcast (the interpreter needs it)
    wmask = d_mask & (zero_d + slot >= 0) & (zero_d + hb == 0)
    k_row = tl.load(k_ptr + row * stride_k_tok + kv_head * stride_k_head + offs_d, mask=wmask,
                    other=0.0).to(tl.float32)
    v_row = tl.load(v_ptr + row * stride_v_tok + kv_head * stride_v_head + offs_d, mask=wmask,
                    other=0.0).to(tl.float32)
    dst = slot * stride_cache_row + kv_head * HEAD_DIM + offs_d
    tl.store(k_cache_ptr + dst, round_to(k_row, cache_ty).to(cache_ty), mask=wmask)
    tl.store(v_cache_ptr + dst, round_to(v_row, cache_ty).to(cache_ty), mask=wmask)
    req, req_start, req_end, seq_len = _row_request(query_start_loc_ptr, seq_lens_ptr, row32,
                                                    num_requests, SEARCH)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    out_ptrs = out_ptr + row * stride_out_tok + heads[:, None] * stride_out_head + offs_d[None, :]
    out_mask = h_ok[:, None] & d_mask[None, :]
    if req >= num_requests:  # padding row: zeros
        tl.store(out_ptrs, tl.zeros([BLOCK_H, HEAD_DIM_PAD], tl.float32).to(
            out_ptr.dtype.element_ty), mask=out_mask)
        return
    context = seq_len - (req_end - req_start)
    pos = context + row32 - req_start
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    et_row_ptr = entry_table_ptr + req.to(tl.int64) * stride_et_req
    q = tl.load(q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=out_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], tl.float32)
    if HAS_SINKS:  # the sink logit (natural units) starts each head's softmax
        m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
        m_i = m_i * 1.4426950408889634  # log2(e): the kernel's scores are in the log2 domain
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    # the window's keys: lo .. pos (pool rows below the context, the step's own from k / v)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = pos * 0
    offs_n = tl.arange(0, TILE_N)
    for t in range(lo // TILE_N, pos // TILE_N + 1):
        p = t * TILE_N + offs_n
        vis = (p >= lo) & (p <= pos)
        old = vis & (p < context)
        new = vis & (p >= context)
        rows = _pool_rows(bt_row_ptr, p, old, kv_head, stride_cache_row, PAGE_SIZE, HEAD_DIM)
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, rows, old, offs_d, d_mask, offs_d, d_mask,
                        HEAD_DIM, HEAD_DIM)
        k_new, v_new = _new_kv_tile(k_ptr, v_ptr, cache_ty, req_start, context, p, new,
                                    kv_head, offs_d, d_mask, stride_k_tok, stride_k_head,
                                    stride_v_tok, stride_v_head)
        k = tl.where(new[:, None], k_new, k)
        v = tl.where(new[:, None], v_new, v)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, k, v, vis[None, :], m_i, l_i, acc, scale_log2, 0.0,
                                      DOT_PRECISION, True, False)
    # the compressed entries the query may see (key and value: one row for every head)
    seen = (pos + 1) // RATE
    offs_e = tl.arange(0, TILE_E)
    if HAS_TOPK:
        e_tiles = tl.cdiv(num_picks, TILE_E)
    else:
        e_tiles = tl.cdiv(seen, TILE_E)
    for t in range(0, e_tiles):
        j = t * TILE_E + offs_e
        if HAS_TOPK:
            s = tl.load(topk_ptr + row * stride_topk_tok + j, mask=j < num_picks,
                        other=-1).to(tl.int32)
            ok = (s >= 0) & (s < seen)
        else:
            s = j
            ok = j < seen
        page = tl.load(et_row_ptr + s // ENTRY_PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        e_rows = page * ENTRY_PAGE_SIZE + s % ENTRY_PAGE_SIZE
        ent = tl.load(entries_ptr + e_rows[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=ok[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            ent = ent.to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, ent, ent, ok[None, :], m_i, l_i, acc, scale_log2, 0.0,
                                      DOT_PRECISION, True, False)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class CompressedAttentionPlan:
    """Tiles and grid of one compressed attention launch."""

    block_h: int
    """Query heads of one KV head per program (``tl.dot``'s M, at least 16)."""
    num_hb: int
    """Head blocks per KV head."""
    tile_n: int
    """Window keys per step."""
    tile_e: int
    """Entries per step."""
    grid: tuple[int, int]
    num_warps: int


@functools.lru_cache(maxsize=256)
def plan_compressed_attention(num_tokens: int, num_heads: int, num_kv_heads: int,
                              head_dim: int) -> CompressedAttentionPlan:
    """Tiles from host ints: 16 heads a program, 16 keys a step at head dims past 128 (the
    fp32 accumulator and a K tile stay in registers), else 32."""
    group = num_heads // num_kv_heads
    block_h = 16
    num_hb = triton.cdiv(group, block_h)
    dpad = head_dim_pad(head_dim)
    tile = 16 if dpad > 128 else 32
    return CompressedAttentionPlan(block_h, num_hb, tile, tile,
                                   (num_tokens, num_kv_heads * num_hb),
                                   4 if dpad <= 128 else 8)


def compressed_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                block_table: torch.Tensor, slot_mapping: torch.Tensor,
                                scale: float, window: int, softcap: float,
                                sinks: torch.Tensor | None, entries: torch.Tensor,
                                fresh: torch.Tensor, rate: int,
                                topk: torch.Tensor | None = None,
                                entry_block_table: torch.Tensor | None = None,
                                plan: CompressedAttentionPlan | None = None) -> torch.Tensor:
    """``dspark::compressed_attention`` in one launch (module docstring): ``[N, H, D]`` in q's
    dtype, padding rows zeros; writes the step's K/V into the pools. ``plan`` overrides the
    tiles (tests); ``entry_block_table``: the entries' own table (None: ``block_table``)."""
    from ..ops.attention_reference import check_semantics
    from ..ops.compressed_reference import check_entries

    check_semantics("compressed_attention_triton", window, softcap, sinks, q.shape[1])
    check_entries("compressed_attention_triton", q, entries, fresh, rate, topk, 1)
    n, heads, dim = q.shape
    if k.shape[1] != 1 or v.shape[2] != dim or softcap:
        raise ValueError(f"compressed_attention_triton: k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, softcap {softcap}; the kernel takes one K=V head "
                         "of q's head dim and no softcap")
    named = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, entries=entries,
                 query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                 slot_mapping=slot_mapping)
    if entry_block_table is not None:
        if entry_block_table.shape != block_table.shape:
            raise ValueError(f"compressed_attention_triton: entry_block_table "
                             f"{tuple(entry_block_table.shape)} must be shaped like block_table "
                             f"{tuple(block_table.shape)}")
        named["entry_block_table"] = entry_block_table
    entry_table = block_table if entry_block_table is None else entry_block_table
    if topk is not None:
        named["topk"] = topk
    if sinks is not None:
        named["sinks"] = sinks
    for name, t in named.items():
        if t.device != q.device or not t.is_contiguous():
            raise ValueError(f"compressed_attention_triton: {name} is on {t.device} "
                             f"({'' if t.is_contiguous() else 'not '}contiguous); every tensor "
                             f"must be contiguous on {q.device}")
    if k_cache.shape[2:] != (1, dim) or v_cache.shape != k_cache.shape \
            or v_cache.dtype != k_cache.dtype or entries.dtype != k_cache.dtype:
        raise ValueError(f"compressed_attention_triton: k_cache {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}, v_cache {tuple(v_cache.shape)} {v_cache.dtype}, "
                         f"entries {entries.dtype}; the pools must be [pages, page_size, 1, "
                         f"{dim}] of one dtype, the entries' too")
    out = torch.empty_like(q)
    if n == 0:
        return out
    plan = plan or plan_compressed_attention(n, heads, 1, dim)
    max_keys = block_table.shape[1] * k_cache.shape[1]
    window = window if window < max_keys else 0  # a window past every position: causal
    launch(_compressed_attention_kernel, plan.grid,
           out, q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping,
           q if sinks is None else sinks, entries, q if topk is None else topk, entry_table,
           float(scale) * _LOG2E, window, seq_lens.shape[0],
           0 if topk is None else topk.shape[1], q.stride(0), q.stride(1), k.stride(0),
           k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
           block_table.stride(0), entry_table.stride(0),
           0 if topk is None else topk.stride(0), dim,
           GROUP=heads, BLOCK_H=plan.block_h, NUM_HB=plan.num_hb, HEAD_DIM=dim,
           HEAD_DIM_PAD=head_dim_pad(dim), PAGE_SIZE=k_cache.shape[1],
           ENTRY_PAGE_SIZE=entries.shape[1], RATE=int(rate), TILE_N=plan.tile_n,
           TILE_E=plan.tile_e, SEARCH=_SEARCH, UPCAST=q.dtype != k_cache.dtype or q.is_cpu,
           DOT_PRECISION=DOT_PRECISION, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None,
           HAS_TOPK=topk is not None, num_warps=plan.num_warps)
    return zeros_when_warming(out)
