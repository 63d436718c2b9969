"""Triton lowering of ``dspark::ragged_attention``: paged KV write + ragged causal attention.

Kernels first, then the launch plan and the host wrapper (the order of the Triton tutorials);
the oracle is :func:`dspark_compile.lowering.reference.ragged_attention`.

Design (one launch, two when the context is split):

- Grid ``(N // BLOCK_Q + R + 1, Hkv, splits)``, from shapes only. Axis 0 enumerates q-blocks:
  request ``i`` owns block ids ``qsl[i] // BLOCK_Q + i ..`` (a strictly increasing start, so a
  binary search over ``query_start_loc`` finds it on the device, empty requests included);
  ids past the last request belong to a pseudo-request holding the padding rows
  ``qsl[R] .. N - 1``, which come out as zeros. Surplus programs exit at once.
- A program's tile is ``BLOCK_Q`` query tokens x the ``GROUP`` query heads of one KV head
  (``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows), so every K/V load serves the whole group: at
  verify widths (``max_query_len <= BLOCK_Q``) each request's KV is read once per KV head.
- The KV write is fused: split 0 of each q-block writes its rows' K/V into the pool, and the
  attention reads the request's *own* new keys straight from ``k``/``v`` (cast to the pool's
  dtype, as the pool would hold them), so no program reads a pool row written in the same
  launch. Precondition (what ``VerifierState.slot_mapping`` produces): ``slot_mapping`` of row
  ``qsl[i] + j`` is the pool row of position ``context_i + j`` in ``block_table[i]``.
- Keys ``< context`` come from the pool and are visible to every query of the request: that
  loop has no masks. The tail (the request's own new keys) masks scores to ``-inf`` before the
  max, and drops non-finite V of keys a row may not see before ``P @ V`` (``0 * NaN`` is NaN):
  a NaN/Inf in a rejected draft's K/V cannot reach an earlier row. A row that does see a
  non-finite V gets NaN in that channel (the reference gives NaN, or Inf for an Inf).
- Split-KV: the key tiles of a q-block are spread evenly over ``splits`` programs that write
  fp32 partials (unnormalised acc, running max, sum); a reduce kernel merges them. The split
  count comes from shapes (see :func:`plan_attention`), never from device values.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .targets import TargetConfig, target_for_device

__all__ = ["AttentionPlan", "plan_attention", "ragged_attention_triton"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, block_id, num_requests, BLOCK_Q: tl.constexpr):
    """Largest ``i`` in ``0..R`` with ``qsl[i] // BLOCK_Q + i <= block_id`` (``R``: padding)."""
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if start // BLOCK_Q + mid <= block_id:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, row0, num_rows,
                  kv_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                  stride_cache_row, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr):
    """Pool rows ``slot_mapping[n]`` (skipped when < 0) <- ``k, v [n, kv_head, :]``."""
    offs_r = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    rows = (row0 + offs_r).to(tl.int64)  # [BLOCK_Q]
    slot = tl.load(slot_mapping_ptr + rows, mask=offs_r < num_rows, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_Q, HEAD_DIM_PAD]
    k = tl.load(k_ptr + rows[:, None] * stride_k_tok + kv_head * stride_k_head + offs_d[None, :],
                mask=mask)
    v = tl.load(v_ptr + rows[:, None] * stride_v_tok + kv_head * stride_v_head + offs_d[None, :],
                mask=mask)
    dst = slot[:, None] * stride_cache_row + kv_head * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pool_offsets(block_table_row_ptr, pos, mask, kv_head, offs_d, stride_cache_row,
                  PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offsets ``[TILE_N, HEAD_DIM_PAD]`` of key positions ``pos`` in a paged pool."""
    page = tl.load(block_table_row_ptr + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    row = page * PAGE_SIZE + pos % PAGE_SIZE  # [TILE_N] flat pool row
    return row[:, None] * stride_cache_row + kv_head * HEAD_DIM + offs_d[None, :]


@triton.jit
def _softmax_step(q, k, v, s_mask, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr,
                  MASKED: tl.constexpr):
    """One online-softmax step over a key tile (scores in the log2 domain, fp32 state)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))  # before the max: hidden keys never count
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tail_step(q, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_row_ptr, t, context, kv_end,
               req_start, q_pos, kv_head, offs_n, offs_d, d_mask, m_i, l_i, acc, scale_log2,
               stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cache_row,
               PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A key tile that reaches the request's own new keys (read from ``k``/``v``, masked)."""
    pos = t * TILE_N + offs_n  # [TILE_N]
    in_pool = pos < context
    is_new = (pos >= context) & (pos < kv_end)
    pool_off = _pool_offsets(bt_row_ptr, pos, in_pool, kv_head, offs_d, stride_cache_row,
                             PAGE_SIZE, HEAD_DIM)
    new_row = (req_start + pos - context).to(tl.int64)  # packed row of a new key
    pm = in_pool[:, None] & d_mask[None, :]
    nm = is_new[:, None] & d_mask[None, :]
    cache_ty = k_cache_ptr.dtype.element_ty
    k = tl.load(k_cache_ptr + pool_off, mask=pm, other=0.0) + tl.load(
        k_ptr + new_row[:, None] * stride_k_tok + kv_head * stride_k_head + offs_d[None, :],
        mask=nm, other=0.0).to(cache_ty)
    v_new = tl.load(v_ptr + new_row[:, None] * stride_v_tok + kv_head * stride_v_head
                    + offs_d[None, :], mask=nm, other=0.0).to(cache_ty)
    bad = ~(tl.abs(v_new.to(tl.float32)) < float("inf"))  # NaN or Inf in a new value
    v = tl.load(v_cache_ptr + pool_off, mask=pm, other=0.0) + tl.where(bad, 0.0, v_new)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    visible = (pos[None, :] <= q_pos[:, None]) & (pos < kv_end)[None, :]  # [BLOCK_M, TILE_N]
    m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2, DOT_PRECISION,
                                  True)
    # A row that sees a non-finite value gets NaN in that channel; rows that do not see it
    # are untouched (bad values were zeroed above, so 0 * NaN never happens).
    hits = tl.dot(visible.to(tl.float16), bad.to(tl.float16), out_dtype=tl.float32)
    return m_i, l_i, tl.where(hits > 0, float("nan"), acc)


@triton.jit
def _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tokens, heads, row_ok,
                offs_d, d_mask, split, num_tokens, stride_out_tok, stride_out_head,
                NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Final rows (``acc / l`` in the output dtype) or, when split, fp32 partials."""
    mask = row_ok[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptrs = out_ptr + tokens[:, None] * stride_out_tok + heads[:, None] * stride_out_head
        tl.store(ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (split * num_tokens + tokens) * NUM_HEADS + heads  # [BLOCK_M] in [S, N, H]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _ragged_attention_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr, slot_mapping_ptr, scale_log2,
        num_tokens, num_requests, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
        stride_v_tok, stride_v_head, stride_out_tok, stride_out_head, stride_bt_req,
        stride_cache_row, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    """One (q-block, KV head, split): fused KV write, then attention over the paged context."""
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, block_id, num_requests, BLOCK_Q)
    is_pad = req >= num_requests
    req_start = tl.load(query_start_loc_ptr + req)
    req_end = tl.load(query_start_loc_ptr + req + 1, mask=req < num_requests, other=0)
    req_len = tl.where(is_pad, num_tokens - req_start, req_end - req_start)
    q0 = (block_id - (req_start // BLOCK_Q + req)) * BLOCK_Q  # first own query of the block
    if q0 >= req_len:
        return
    n_q = tl.minimum(req_len - q0, BLOCK_Q)
    if split == 0:
        _write_new_kv(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, req_start + q0,
                      n_q, kv_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                      stride_cache_row, BLOCK_Q, HEAD_DIM, HEAD_DIM_PAD)
    offs_m = tl.arange(0, BLOCK_M)  # row r: query r // GROUP_PAD, head r % GROUP_PAD
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    d_mask = offs_d < HEAD_DIM
    q_idx = offs_m // GROUP_PAD
    row_ok = (q_idx < n_q) & (offs_m % GROUP_PAD < GROUP)  # [BLOCK_M]
    tokens = (req_start + q0 + q_idx).to(tl.int64)
    heads = kv_head * GROUP + offs_m % GROUP_PAD
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if is_pad:  # padding rows: zeros (the reduce writes them when split)
        if NUM_SPLITS == 1:
            _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tokens, heads,
                        row_ok, offs_d, d_mask, split, num_tokens, stride_out_tok,
                        stride_out_head, NUM_HEADS, HEAD_DIM, NUM_SPLITS)
        return
    q = tl.load(q_ptr + tokens[:, None] * stride_q_tok + heads[:, None] * stride_q_head
                + offs_d[None, :], mask=row_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    context = tl.load(seq_lens_ptr + req) - req_len
    kv_end = context + q0 + n_q  # keys the block's last query sees
    n_tiles = tl.cdiv(kv_end, TILE_N)
    t_lo = split * n_tiles // NUM_SPLITS
    t_hi = (split + 1) * n_tiles // NUM_SPLITS
    full = context // TILE_N  # tiles wholly inside the committed context
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    for t in range(t_lo, tl.minimum(t_hi, full)):
        off = _pool_offsets(bt_row_ptr, t * TILE_N + offs_n, offs_n < TILE_N, kv_head, offs_d,
                            stride_cache_row, PAGE_SIZE, HEAD_DIM)
        k = tl.load(k_cache_ptr + off, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + off, mask=d_mask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, k, v, row_ok, m_i, l_i, acc, scale_log2,
                                      DOT_PRECISION, False)
    q_pos = context + q0 + q_idx  # [BLOCK_M] position of each row's query
    for t in range(tl.maximum(t_lo, full), t_hi):
        m_i, l_i, acc = _tail_step(
            q, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_row_ptr, t, context, kv_end,
            req_start, q_pos, kv_head, offs_n, offs_d, d_mask, m_i, l_i, acc, scale_log2,
            stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_cache_row,
            PAGE_SIZE, HEAD_DIM, TILE_N, UPCAST, DOT_PRECISION)
    _store_rows(out_ptr, part_acc_ptr, part_ml_ptr, acc, m_i, l_i, tokens, heads, row_ok,
                offs_d, d_mask, split, num_tokens, stride_out_tok, stride_out_head, NUM_HEADS,
                HEAD_DIM, NUM_SPLITS)


@triton.jit
def _split_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, query_start_loc_ptr, num_tokens,
                         num_requests, stride_out_tok, stride_out_head,
                         NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    """Merge the split partials of one token row ``[H, D]``; padding rows become zeros."""
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    out_ptrs = out_ptr + token * stride_out_tok + offs_h[:, None] * stride_out_head + offs_d[None, :]
    acc = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], tl.float32)
    if token >= tl.load(query_start_loc_ptr + num_requests):
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
        return
    m_max = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        row = (s * num_tokens + token) * NUM_HEADS + offs_h
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + row * 2, mask=offs_h < NUM_HEADS,
                                          other=float("-inf")))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([HEADS_PAD], tl.float32)
    for s in range(NUM_SPLITS):
        row = (s * num_tokens + token) * NUM_HEADS + offs_h
        m_s = tl.load(part_ml_ptr + row * 2, mask=offs_h < NUM_HEADS, other=float("-inf"))
        w = tl.exp2(m_s - m_use)  # [HEADS_PAD]; 0 for a split that saw no key
        l_sum += w * tl.load(part_ml_ptr + row * 2 + 1, mask=offs_h < NUM_HEADS, other=0.0)
        part = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask,
                       other=0.0)
        acc += w[:, None] * part
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class AttentionPlan:
    """Tiles, split count and grid of one launch, derived from shapes and a target only."""

    block_q: int
    """Query tokens per program."""
    group_pad: int
    """Query heads per KV head, rounded up to a power of two."""
    block_m: int
    """Rows of a program's tile: ``block_q * group_pad``."""
    tile_n: int
    """Keys per iteration."""
    num_splits: int
    """Programs sharing one q-block's keys (1: no split, no reduce kernel)."""
    grid: tuple[int, int, int]
    """``(num_tokens // block_q + num_requests + 1, num_kv_heads, num_splits)``."""


@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device) -> tuple[TargetConfig, int]:
    """Target entry and multiprocessor count of a device (asked once per device)."""
    cfg = target_for_device(device)
    if device.type == "cuda":
        return cfg, torch.cuda.get_device_properties(device).multi_processor_count
    return cfg, cfg.default_sm_count


@functools.lru_cache(maxsize=1024)  # a pure function of ints: ~10 us of Python per call saved
def plan_attention(num_tokens: int, num_requests: int, num_heads: int, num_kv_heads: int,
                   max_keys: int, max_query_len: int, cfg: TargetConfig, sm_count: int,
                   num_splits: int | None = None) -> AttentionPlan:
    """Choose tiles and the split count from host ints (no device value is read).

    ``BLOCK_Q`` covers ``max_query_len`` (a verify block is one tile, so its KV is read once
    per KV head) within ``cfg.attn_max_block_m`` rows, and at least 16 rows (``tl.dot``).
    Split rule: when the programs that have work, ``min(R, N) * ceil(max_query_len / BLOCK_Q)
    * Hkv``, are fewer than ``cfg.split_waves * sm_count``, split each q-block's keys into
    enough parts to reach that, at most ``cfg.split_max`` and at least ``cfg.split_min_keys``
    keys (``max_keys``: the block table's width in tokens) per part. At 16/8 heads on an H200
    (132 SMs) this splits bs 1 and 8 and leaves bs >= 64 whole.
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = max(16, group_pad, min(triton.next_power_of_2(max_query_len) * group_pad,
                                     cfg.attn_max_block_m))
    block_q = block_m // group_pad
    if num_splits is None:
        busy = max(1, min(num_requests, num_tokens)) * num_kv_heads * -(-max_query_len // block_q)
        most = max(1, min(cfg.split_max, max_keys // cfg.split_min_keys))
        num_splits = min(most, max(1, -(-cfg.split_waves * sm_count // busy)))
    grid = (num_tokens // block_q + num_requests + 1, num_kv_heads, num_splits)
    return AttentionPlan(block_q, group_pad, block_m, cfg.attn_tile_n, num_splits, grid)


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)
_ARG_RULES = (("q", 3, _FLOATS), ("k", 3, _FLOATS), ("v", 3, _FLOATS), ("k_cache", 4, _FLOATS),
              ("v_cache", 4, _FLOATS), ("query_start_loc", 1, _INTS), ("seq_lens", 1, _INTS),
              ("block_table", 2, _INTS), ("slot_mapping", 1, _INTS))


def _fail(msg: str) -> None:
    raise ValueError(f"ragged_attention_triton: {msg}")


def _check_tensors(tensors: tuple) -> None:
    """Each argument is a tensor of the right rank and dtype, on q's device."""
    device = tensors[0].device if isinstance(tensors[0], torch.Tensor) else None
    for (name, dims, dtypes), t in zip(_ARG_RULES, tensors):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} is {type(t).__name__}; it must be a tensor")
        if t.dim() != dims:
            _fail(f"{name} has shape {tuple(t.shape)}; it must be {dims}-D")
        if t.dtype not in dtypes:
            _fail(f"{name} has dtype {t.dtype}; it must be one of {dtypes}")
        if t.device != device:
            _fail(f"{name} is on {t.device} but q is on {device}; move every argument there")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        _fail("CPU tensors need TRITON_INTERPRET=1 set before triton kernels are imported; "
              "for the CPU path call dspark_compile.lowering.reference.ragged_attention")


def _check_inputs(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                  slot_mapping, max_query_len) -> None:
    """Raise ``ValueError`` naming the argument, its value and the rule it breaks.

    Messages are formatted only on failure: this runs on every call (~10 us budget).
    """
    _check_tensors((q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                    slot_mapping))
    n, h, d = q.shape
    pages, page_size, hkv, dc = k_cache.shape
    r = query_start_loc.shape[0] - 1
    if k.shape != (n, hkv, d) or v.shape != (n, hkv, d):
        _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [N, Hkv, D] = "
              f"{(n, hkv, d)} (N, D from q, Hkv from k_cache)")
    if dc != d or h % hkv:
        _fail(f"k_cache {tuple(k_cache.shape)} must have head dim {d} (q's) and a number of "
              f"KV heads that divides q's {h} heads")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        _fail(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
              f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _fail("the KV pools must be contiguous")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or block_table.stride(1) != 1:
        _fail("q, k, v and block_table need a dense last dim")
    if r < 0 or seq_lens.shape[0] != r or block_table.shape[0] != r:
        _fail(f"query_start_loc {tuple(query_start_loc.shape)} describes R={r} requests; "
              f"seq_lens {tuple(seq_lens.shape)} and block_table {tuple(block_table.shape)} "
              "need R rows")
    if slot_mapping.shape[0] != n:
        _fail(f"slot_mapping has shape {tuple(slot_mapping.shape)}; it must be ({n},), one "
              "pool row per packed token")
    if max_query_len is not None and (type(max_query_len) is not int or max_query_len < 1):
        _fail(f"max_query_len={max_query_len!r}; it must be None or a python int >= 1")


def ragged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                            max_query_len: int | None = None, num_splits: int | None = None,
                            config: TargetConfig | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``dspark::ragged_attention``: same arguments and result as the reference.

    ``max_query_len``: a host bound on any request's length (default ``N``, always safe); a
    tighter bound lets one program cover a whole verify block. ``num_splits`` and ``config``
    override the split rule and the target entry (benchmarks, tests); ``out`` is an optional
    ``[N, H, D]`` buffer of q's dtype to write (every element is written). Mutates the pools;
    no host sync, so it can be captured in a CUDA graph. Returns ``[N, H, D]`` in q's dtype.
    """
    _check_inputs(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                  slot_mapping, max_query_len)
    n, h, d = q.shape
    r = query_start_loc.shape[0] - 1
    hkv, page_size = k_cache.shape[2], k_cache.shape[1]
    cfg, sm_count = _device_target(q.device)
    cfg = config or cfg
    plan = plan_attention(n, r, h, hkv, block_table.shape[1] * page_size,
                          max(1, max_query_len or n), cfg, sm_count, num_splits)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [N, H, D]
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or \
            out.stride(2) != 1:
        raise ValueError(f"ragged_attention_triton: out {tuple(out.shape)} {out.dtype} on "
                         f"{out.device} must match q {tuple(q.shape)} {q.dtype} on {q.device} "
                         "with a dense last dim")
    if n == 0:
        return out
    split = plan.num_splits > 1
    part_acc, part_ml = out, out  # never touched without a split (the branch compiles out)
    if split:
        part_acc = q.new_empty((plan.num_splits, n, h, d), dtype=torch.float32)
        part_ml = q.new_empty((plan.num_splits, n, h, 2), dtype=torch.float32)
    d_pad = triton.next_power_of_2(d)
    _ragged_attention_kernel[plan.grid](
        out, part_acc, part_ml, q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
        block_table, slot_mapping, scale * _LOG2E, n, r, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), hkv * d, NUM_HEADS=h, GROUP=h // hkv, GROUP_PAD=plan.group_pad,
        HEAD_DIM=d, HEAD_DIM_PAD=d_pad, PAGE_SIZE=page_size, BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m, TILE_N=plan.tile_n, NUM_SPLITS=plan.num_splits,
        UPCAST=q.dtype != k_cache.dtype, DOT_PRECISION=cfg.fp32_dot_precision,
        num_warps=cfg.attn_num_warps, num_stages=cfg.attn_num_stages)
    if split:
        _split_reduce_kernel[(n,)](
            out, part_acc, part_ml, query_start_loc, n, r, out.stride(0), out.stride(1),
            NUM_HEADS=h, HEADS_PAD=triton.next_power_of_2(h), HEAD_DIM=d, HEAD_DIM_PAD=d_pad,
            NUM_SPLITS=plan.num_splits, num_warps=cfg.reduce_num_warps)
    return out
