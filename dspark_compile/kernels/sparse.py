"""Triton lowerings of the sparse-attention ops (DeepSeek Sparse Attention, DSA):
``dspark::sparse_attention`` and ``dspark::sparse_index``. No host sync (they run inside CUDA
graphs); every launch's grid comes from shapes only.

``sparse_attention_triton`` is two launches on the stream:

1. ``rows.store_rows_triton`` writes the step's K and V rows into the paged pools at
   ``slot_mapping`` (< 0: nothing), cast to the pools' dtype;
2. ``_sparse_attention_kernel``, grid ``(N, Hkv * head blocks)``: program ``(t, g)`` takes
   packed row ``t`` and the ``BLOCK_H`` query heads of head block ``g % NUM_HB`` of KV head
   ``g // NUM_HB`` (GQA: query head ``h`` reads KV head ``h // (H / Hkv)``). It finds its
   request and position ``p`` (:func:`.metadata.row_request`; a row past ``qsl[R]`` writes
   zeros), then runs one online softmax (float32 state, log2 domain) over its ``picks`` row in
   blocks of ``TILE_P`` picks: a pick ``s`` counts when ``0 <= s <= p``; its K and V rows are
   read from the pools through the request's block-table row. Invalid picks (-1, past the
   query, past ``P`` in the last block) are never loaded and score ``-inf``; a row with no valid
   pick writes zeros. With ``sinks``, head ``h``'s sink logit starts its softmax (the running
   maximum, weight 1, no value), so it joins the denominator only; a row with no valid pick
   still writes zeros (its accumulator stays 0).

Race-free by stream order: every key the attention reads, the step's own included, comes from
the pools after launch 1 has finished (neither launch uses PDL, so the second starts only
when the first has ended), exactly as the reference reads them after ``kv_write``. The
attention kernel writes nothing but its output. A pick is any position of the request, so one
path (pool rows through the block table) serves every key; reading the step's own keys from
``k`` / ``v`` instead would save the one small store launch at the cost of a second path per
pick tile.

Head dims are padded to a power of two (at least 16) with masks; Dk and Dv are independent
(DeepSeek MLA: 192 / 128). Scores and the ``P @ V`` products are ``tl.dot`` tiles in the pools'
dtype (bf16 on tensor cores, P rounded to it, as the ragged attention does), accumulated in
float32; float32 operands take ``ieee``. Under the interpreter (CPU tensors), or where q's dtype
is not the pools', every tile is made float32 first (the interpreter's ``tl.dot`` of bf16 tiles
is wrong).

``sparse_index_triton`` stores the step's indexer keys into ``key_pool`` with the same store, then runs :func:`.index_topk.index_topk_triton` over the pool with ``rate`` 1 (one entry
per token), which reads the keys after that launch too.

Per-head and block picks (MiniMax-M3's block-sparse layers): picks ``[N, Hp, P]`` give query
head ``h`` the row ``h // (H / Hp)``, so a program takes the heads that share both its KV head
and its pick row (``gcd(H / Hkv, H / Hp)`` of them; ``[N, P]`` is ``Hp = 1``, a program per KV
head's block of heads as above). With ``PICK_BLOCK`` B > 1 the softmax walks ``P * B`` key
slots: slot ``j`` is position ``picks[j // B] * B + j % B``, counted when the pick is valid and
the position at most the query's.

``block_index_triton`` stores the step's indexer keys the same way, then ``_block_scores``
(program ``(t, split)``: query row ``t``, blocks ``split, split + splits, ..`` of every block a
slot can hold) takes, per indexer head, the float32 ``ieee`` dot of the query with each key of
the block up to the query's position and keeps the maximum (-inf for a block past the query),
+inf for the ``local`` blocks ending at the query's own; ``torch.topk`` on the device keeps the
best ``topk`` and -inf picks become -1. Equal finite maxima at the boundary are left to the
device's ``topk`` (distinct keys never share a block, so they are rare; the +inf local blocks
all fit, ``local <= topk``).

Semantics and the oracle: ``ops/sparse_reference``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention import _pool_rows, _softmax_step, head_dim_pad
from .launch import dense, launch, zeros_when_warming
from .metadata import row_request
from .rows import store_rows_triton

__all__ = ["SparseAttentionPlan", "plan_sparse_attention", "sparse_attention_triton",
           "sparse_index_triton", "block_index_triton"]

_LOG2E = 1.4426950408889634
CHUNK = 128
"""Requests counted per step when a row looks for its request."""
DOT_PRECISION = "ieee"
"""``input_precision`` of the dots on float32 operands."""


@triton.jit
def _sparse_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr,
        block_table_ptr, picks_ptr, sinks_ptr, scale_log2, num_requests, num_picks,
        stride_bt_req,
        GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
        UNIT: tl.constexpr, SPAN: tl.constexpr, PICK_ROWS: tl.constexpr,
        PICK_BLOCK: tl.constexpr,
        BLOCK_H: tl.constexpr, NUM_HB: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
        PAGE_SIZE: tl.constexpr, TILE_P: tl.constexpr, CHUNK: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One (query row, unit of ``UNIT`` query heads sharing a KV head and a pick row, block of
    them): an online softmax over the keys at the row's valid picks, read from the pools
    (module docstring)."""
    row32 = tl.program_id(0)
    row = row32.to(tl.int64)
    unit = tl.program_id(1) // NUM_HB
    hb = tl.program_id(1) % NUM_HB
    req, pos, real = row_request(query_start_loc_ptr, seq_lens_ptr, row32, num_requests, CHUNK)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < UNIT
    first = unit * UNIT
    kv_head = first // GROUP
    heads = first + offs_h
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_mask = offs_dv < HEAD_DIM_V
    q = tl.load(q_ptr + row * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM
                + offs_d[None, :], mask=h_ok[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    picks_row_ptr = picks_ptr + (row * PICK_ROWS + first // SPAN) * num_picks
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_V_PAD], tl.float32)
    if HAS_SINKS:  # the sink logit (natural units) starts each head's softmax
        m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32)
        m_i = m_i * 1.4426950408889634  # log2(e): the scores are in the log2 domain
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    offs_p = tl.arange(0, TILE_P)
    slots = num_picks * PICK_BLOCK
    tiles = tl.where(real, tl.cdiv(slots, TILE_P), 0)  # a padding row reads nothing
    for t in range(0, tiles):
        j = t * TILE_P + offs_p
        pick = tl.load(picks_row_ptr + j // PICK_BLOCK, mask=j < slots, other=-1)
        s = pick * PICK_BLOCK + j % PICK_BLOCK
        ok = (pick >= 0) & (s <= pos)
        s = tl.where(ok, s, 0).to(tl.int32)
        page = tl.load(bt_row_ptr + s // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        slot = page * PAGE_SIZE + s % PAGE_SIZE
        k_rows = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
        v_rows = slot * (NUM_KV_HEADS * HEAD_DIM_V) + kv_head * HEAD_DIM_V
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :],
                    mask=ok[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_dv[None, :],
                    mask=ok[:, None] & dv_mask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        m_i, l_i, acc = _softmax_step(q, k, v, ok[None, :], m_i, l_i, acc, scale_log2, 0.0,
                                      DOT_PRECISION, True, False)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_ptrs = out_ptr + row * (NUM_HEADS * HEAD_DIM_V) + heads[:, None] * HEAD_DIM_V \
        + offs_dv[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & dv_mask[None, :])


@dataclass(frozen=True)
class SparseAttentionPlan:
    """Tiles and grid shape of one sparse attention launch."""

    block_h: int
    """Query heads of one KV head per program (``tl.dot``'s M, at least 16)."""
    num_hb: int
    """Head blocks per KV head."""
    tile_p: int
    """Picks per online-softmax step."""
    num_warps: int


@functools.lru_cache(maxsize=256)
def plan_sparse_attention(num_heads: int, num_kv_heads: int, head_dim: int,
                          head_dim_v: int, pick_rows: int = 1) -> SparseAttentionPlan:
    """Tiles from host ints: 16 query heads a program (of a unit sharing a KV head and a pick
    row); 16 picks a step where a padded head dim passes 128 (the float32 accumulator and the
    K / V tiles stay in registers), else 32."""
    unit = math.gcd(num_heads // num_kv_heads, num_heads // pick_rows)
    block_h = 16
    dpad = max(head_dim_pad(head_dim), head_dim_pad(head_dim_v))
    return SparseAttentionPlan(block_h, triton.cdiv(unit, block_h), 16 if dpad > 128 else 32,
                               4 if dpad <= 128 else 8)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _check_placement(op: str, device: torch.device, named: dict) -> None:
    """Every tensor of ``named`` is contiguous on ``device``."""
    for name, t in named.items():
        if t.device != device or not t.is_contiguous():
            _fail(op, f"{name} is on {t.device} ({'' if t.is_contiguous() else 'not '}"
                      f"contiguous); every tensor must be contiguous on {device}")


def _check_layout(op: str, n: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The step's metadata: integer ``query_start_loc [R+1]``, ``seq_lens [R]``,
    ``block_table [R, pages]`` and ``slot_mapping [N]``."""
    for name, t, dims in (("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1),
                          ("block_table", block_table, 2), ("slot_mapping", slot_mapping, 1)):
        if t.dim() != dims or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            _fail(op, f"{name} is {t.dtype} {tuple(t.shape)}; it must be a {dims}-D integer "
                      "tensor")
    r = query_start_loc.shape[0] - 1
    if r < 0 or seq_lens.shape[0] != r or block_table.shape[0] != r \
            or slot_mapping.shape[0] != n:
        _fail(op, f"query_start_loc {tuple(query_start_loc.shape)} describes R={r} requests "
                  f"and q N={n} rows: seq_lens {tuple(seq_lens.shape)} and block_table "
                  f"{tuple(block_table.shape)} need R rows, slot_mapping "
                  f"{tuple(slot_mapping.shape)} N")


def _check_interpreter(op: str, device: torch.device) -> None:
    """CPU tensors run only under the Triton interpreter."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        _fail(op, "CPU tensors need TRITON_INTERPRET=1 set before triton kernels are imported; "
                  "on the CPU call dspark_compile.ops.sparse_reference instead")


def _check_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                     slot_mapping, picks, sinks, pick_block) -> None:
    """``sparse_attention_triton``'s arguments: the ragged attention's rules
    (``attention._check_inputs``: dtypes, shapes, layout, sinks, the interpreter), the picks,
    and every tensor contiguous (rows are indexed densely here)."""
    from ..ops.sparse_reference import check_picks
    from .attention import _check_inputs

    op = "sparse_attention_triton"
    _check_inputs((q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                   slot_mapping, None), None, 0, 0.0, sinks, op=op)
    check_picks(op, q.shape, picks, pick_block)
    named = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                 query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                 slot_mapping=slot_mapping, picks=picks)
    if sinks is not None:
        named["sinks"] = sinks
    _check_placement(op, q.device, named)


def sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor,
                            scale: float, picks: torch.Tensor,
                            sinks: torch.Tensor | None = None, pick_block: int = 1,
                            plan: SparseAttentionPlan | None = None) -> torch.Tensor:
    """``dspark::sparse_attention`` (module docstring): writes the step's K/V into the pools,
    then returns ``[N, H, Dv]`` in q's dtype (rows past ``query_start_loc[R]`` and rows with no
    valid pick are zeros). ``picks``: ``[N, P]`` or ``[N, Hp, P]``, each standing for
    ``pick_block`` positions. ``sinks``: None or ``[H]``, one more logit per head in the softmax
    denominator. ``plan`` overrides the tiles (tests)."""
    q, k, v, picks, sinks = dense(q, k, v, picks, sinks)
    _check_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                     slot_mapping, picks, sinks, pick_block)
    n, heads, dim = q.shape
    hkv, dv = k_cache.shape[2], v.shape[2]
    out = q.new_empty((n, heads, dv))
    if n == 0:
        return out
    store_rows_triton(k, k_cache, slot_mapping, v, v_cache)
    r = query_start_loc.shape[0] - 1
    num_picks = picks.shape[-1]
    pick_rows = picks.shape[1] if picks.dim() == 3 else 1
    if r == 0 or num_picks == 0 or dv == 0:  # no request, or nothing to attend to: zeros
        return zeros_when_warming(out.zero_())
    plan = plan or plan_sparse_attention(heads, hkv, dim, dv, pick_rows)
    unit = math.gcd(heads // hkv, heads // pick_rows)
    launch(_sparse_attention_kernel, (n, heads // unit * plan.num_hb),
           out, q, k_cache, v_cache, query_start_loc, seq_lens, block_table, picks,
           q if sinks is None else sinks, float(scale) * _LOG2E, r, num_picks,
           block_table.stride(0),
           GROUP=heads // hkv, NUM_HEADS=heads, NUM_KV_HEADS=hkv, UNIT=unit,
           SPAN=heads // pick_rows, PICK_ROWS=pick_rows, PICK_BLOCK=int(pick_block),
           BLOCK_H=plan.block_h,
           NUM_HB=plan.num_hb, HEAD_DIM=dim, HEAD_DIM_PAD=head_dim_pad(dim), HEAD_DIM_V=dv,
           HEAD_DIM_V_PAD=head_dim_pad(dv), PAGE_SIZE=k_cache.shape[1], TILE_P=plan.tile_p,
           CHUNK=CHUNK, UPCAST=q.dtype != k_cache.dtype or q.is_cpu,
           DOT_PRECISION=DOT_PRECISION, HAS_SINKS=sinks is not None, num_warps=plan.num_warps)
    return zeros_when_warming(out)


def sparse_index_triton(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                        key_pool: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor,
                        slot_mapping: torch.Tensor, topk: int,
                        softmax_scale: float) -> torch.Tensor:
    """``dspark::sparse_index``: writes ``k [N, Di]`` into ``key_pool`` at ``slot_mapping``,
    then the indexer's picks over the pool, int64 ``[N, topk]`` (-1: none;
    :func:`.index_topk.index_topk_triton` with ``rate`` 1)."""
    from ..ops.sparse_reference import check_sparse_index
    from .index_topk import index_topk_triton

    op = "sparse_index_triton"
    q, weights, k = dense(q, weights, k)
    check_sparse_index(op, q, weights, k, key_pool, topk, 1)
    if not key_pool.is_floating_point():
        _fail(op, f"key_pool is {key_pool.dtype}; it must be floating point")
    _check_layout(op, q.shape[0], query_start_loc, seq_lens, block_table, slot_mapping)
    _check_placement(op, q.device, dict(
        q=q, weights=weights, k=k, key_pool=key_pool, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping))
    _check_interpreter(op, q.device)
    store_rows_triton(k, key_pool, slot_mapping)
    return index_topk_triton(q, weights, key_pool, k, query_start_loc, seq_lens, block_table, 1,
                             topk, softmax_scale)


@triton.jit
def _block_scores(q_ptr, key_ptr, qsl_ptr, seq_lens_ptr, table_ptr, out_ptr, num_reqs,
                  stride_table, heads, dim, num_blocks, PAGE_SIZE: tl.constexpr,
                  BLOCK: tl.constexpr, LOCAL: tl.constexpr, H_PAD: tl.constexpr,
                  D_PAD: tl.constexpr, TILE_K: tl.constexpr, CHUNK: tl.constexpr):
    """Row ``t``'s per-head block maxima of its blocks ``split, split + splits, ..`` (module
    docstring) into ``out [N, heads, num_blocks]``."""
    t = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    req, pos, real = row_request(qsl_ptr, seq_lens_ptr, t, num_reqs, CHUNK)
    seen = tl.where(real, pos // BLOCK + 1, 0)  # blocks holding a key the query sees
    own = pos // BLOCK
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok, d_ok = h < heads, d < dim
    live = (h * 0 + seen) > split  # this program sees a block (a [H_PAD] mask)
    q = tl.load(q_ptr + t.to(tl.int64) * heads * dim + h[:, None] * dim + d[None, :],
                mask=(h_ok & live)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    table_row = table_ptr + req.to(tl.int64) * stride_table
    offs_k = tl.arange(0, TILE_K)
    out_row = out_ptr + t.to(tl.int64) * heads * num_blocks + h * num_blocks
    for b in range(split, num_blocks, splits):
        best = tl.full([H_PAD], float("-inf"), tl.float32)
        if b < seen:
            for c in tl.static_range(0, BLOCK, TILE_K):
                s = b * BLOCK + c + offs_k
                ok = (c + offs_k < BLOCK) & (s <= pos)
                rows = _pool_rows(table_row, tl.where(ok, s, 0), ok, 0, dim, PAGE_SIZE, 0)
                k = tl.load(key_ptr + rows[:, None] + d[None, :],
                            mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                dots = tl.dot(q, tl.trans(k), input_precision="ieee")  # [H_PAD, TILE_K]
                dots = tl.where(ok[None, :], dots, float("-inf"))
                best = tl.maximum(best, tl.max(dots, 1))
            if b > own - LOCAL:  # one of the always-kept blocks ending at the query's own
                best = tl.full([H_PAD], float("inf"), tl.float32)
        tl.store(out_row + b, best, mask=h_ok)


def block_index_triton(q: torch.Tensor, k: torch.Tensor, key_pool: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       block_table: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                       topk: int, local: int) -> torch.Tensor:
    """``dspark::block_index`` (module docstring): writes ``k [N, Di]`` into ``key_pool`` at
    ``slot_mapping``, then each query's blocks per indexer head, int64 ``[N, Hi, topk]``
    (-1: none)."""
    from ..ops.sparse_reference import check_block_index
    from .index_topk import plan_index
    from .device import device_sm_count

    op = "block_index_triton"
    q, k = dense(q, k)
    check_block_index(op, q, k, key_pool, block_size, topk, local, 1)
    if not key_pool.is_floating_point():
        _fail(op, f"key_pool is {key_pool.dtype}; it must be floating point")
    _check_layout(op, q.shape[0], query_start_loc, seq_lens, block_table, slot_mapping)
    _check_placement(op, q.device, dict(
        q=q, k=k, key_pool=key_pool, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_table=block_table, slot_mapping=slot_mapping))
    _check_interpreter(op, q.device)
    n, heads, dim = q.shape
    out = torch.full((n, heads, topk), -1, dtype=torch.int64, device=q.device)
    if n == 0:
        return out
    store_rows_triton(k, key_pool, slot_mapping)
    blocks = triton.cdiv(block_table.shape[1] * key_pool.shape[1], block_size)
    if blocks == 0 or query_start_loc.shape[0] == 1:
        return zeros_when_warming(out)
    scores = torch.empty(n, heads, blocks, dtype=torch.float32, device=q.device)
    launch(_block_scores, (n, plan_index(n, blocks, 1, device_sm_count(q.device))), q,
           key_pool, query_start_loc, seq_lens, block_table, scores,
           query_start_loc.shape[0] - 1, block_table.stride(0), heads, dim, blocks,
           PAGE_SIZE=key_pool.shape[1], BLOCK=int(block_size), LOCAL=int(local),
           H_PAD=max(16, triton.next_power_of_2(heads)),
           D_PAD=max(16, triton.next_power_of_2(dim)),
           TILE_K=max(16, min(64, triton.next_power_of_2(block_size))), CHUNK=CHUNK)
    kept = min(topk, blocks)
    best, ids = scores.topk(kept, dim=-1)
    out[..., :kept] = torch.where(best == float("-inf"), -1, ids)
    return zeros_when_warming(out)
