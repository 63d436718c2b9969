"""Triton lowering of a packed batch's device metadata (``VerifierState.device_metadata``).

A verify step starts by turning the layout (``query_start_loc``, context lengths, request
slots) into the per-row positions and KV slots the model reads. As torch ops that is about
fifteen launches of a few microseconds each (a search, gathers, wheres); at a few tokens they
cost as much as a layer. This is one launch with the same results:

- programs ``0 .. cdiv(N, BLOCK_ROWS) - 1`` take ``BLOCK_ROWS`` rows each: the row's request
  is the number of requests ``i`` with ``query_start_loc[i + 1] <= row`` (capped at ``R - 1``),
  counted over the offsets in chunks of ``CHUNK`` (what ``searchsorted(..., right=True)``
  gives); then ``positions``, ``slot_mapping`` (``-1`` past the real rows) and, with mRoPE
  deltas, the shifted positions;
- the next ``cdiv(R, BLOCK_REQS)`` programs copy each request's block-table row (by its slot)
  and write ``seq_lens = context_lens + length``.

No host sync: it runs inside a CUDA graph. The oracle is the torch-op version in
``state.py``; ``tests/test_triton_metadata.py`` compares them on random padded layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, warming
from .pdl import pdl_enter, pdl_options, use_pdl
from .device import device_target

__all__ = ["device_metadata_triton"]

BLOCK_ROWS = 128
BLOCK_REQS = 4
CHUNK = 128


@triton.jit
def row_request(qsl_ptr, seq_lens_ptr, t, num_reqs, CHUNK: tl.constexpr):
    """Packed row ``t``'s request ``req``, its position ``pos`` in that request's sequence and
    whether it is a real row (``real``: below ``qsl[R]``; a padding row gets the last request
    and a position past it). Counts the requests that end at or before ``t``, ``CHUNK`` ends
    per load, as :func:`_row_metadata` does for a block of rows."""
    req = t * 0
    for c in range(0, num_reqs, CHUNK):
        i = c + tl.arange(0, CHUNK)
        ends = tl.load(qsl_ptr + 1 + i, mask=i < num_reqs, other=2147483647)
        req += tl.sum((ends <= t).to(tl.int32), 0)
    req = tl.minimum(req, num_reqs - 1)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    pos = tl.load(seq_lens_ptr + req) - (end - start) + (t - start)
    return req, pos, t < tl.load(qsl_ptr + num_reqs)


@triton.jit
def _row_metadata(qsl_ptr, ctx_ptr, slots_ptr, pool_table_ptr, delta_ptr, pos_ptr,
                  slot_map_ptr, mpos_ptr, num_tokens, num_reqs, stride_pool, page_size, block,
                  BLOCK_ROWS: tl.constexpr, CHUNK: tl.constexpr, MROPE: tl.constexpr):
    """Positions, slot mapping (and mRoPE positions) of rows ``block * BLOCK_ROWS + ...``."""
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_tokens
    req = tl.zeros([BLOCK_ROWS], tl.int32)
    for c in range(0, num_reqs, CHUNK):
        i = c + tl.arange(0, CHUNK)
        ends = tl.load(qsl_ptr + 1 + i, mask=i < num_reqs, other=2147483647)
        req += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), 1)
    req = tl.minimum(req, num_reqs - 1)
    valid = rows < tl.load(qsl_ptr + num_reqs)
    start = tl.load(qsl_ptr + req, mask=row_ok, other=0)
    ctx = tl.load(ctx_ptr + req, mask=row_ok, other=0)
    pos = tl.where(valid, ctx.to(tl.int64) + rows - start, 0)
    slot = tl.load(slots_ptr + req, mask=row_ok, other=0).to(tl.int64)
    page = tl.load(pool_table_ptr + slot * stride_pool + pos // page_size,
                   mask=row_ok & valid, other=0).to(tl.int64)
    tl.store(pos_ptr + rows, pos, mask=row_ok)
    tl.store(slot_map_ptr + rows, tl.where(valid, page * page_size + pos % page_size, -1),
             mask=row_ok)
    if MROPE:
        delta = tl.load(delta_ptr + req, mask=row_ok & valid, other=0).to(tl.int64)
        tl.store(mpos_ptr + rows, pos + delta, mask=row_ok)


@triton.jit
def _request_metadata(qsl_ptr, ctx_ptr, slots_ptr, pool_table_ptr, seq_lens_ptr, table_ptr,
                      num_reqs, pages, stride_pool, block, BLOCK_REQS: tl.constexpr,
                      PAGES_PAD: tl.constexpr):
    """Seq lens and block-table rows of requests ``block * BLOCK_REQS + ...``."""
    reqs = block * BLOCK_REQS + tl.arange(0, BLOCK_REQS)
    req_ok = reqs < num_reqs
    length = tl.load(qsl_ptr + reqs + 1, mask=req_ok, other=0) - \
        tl.load(qsl_ptr + reqs, mask=req_ok, other=0)
    tl.store(seq_lens_ptr + reqs, tl.load(ctx_ptr + reqs, mask=req_ok, other=0) + length,
             mask=req_ok)
    slot = tl.load(slots_ptr + reqs, mask=req_ok, other=0).to(tl.int64)
    cols = tl.arange(0, PAGES_PAD)
    ok = req_ok[:, None] & (cols < pages)[None, :]
    row = tl.load(pool_table_ptr + slot[:, None] * stride_pool + cols[None, :], mask=ok)
    tl.store(table_ptr + reqs[:, None].to(tl.int64) * pages + cols[None, :], row, mask=ok)


@triton.jit
def _metadata_kernel(qsl_ptr, ctx_ptr, slots_ptr, pool_table_ptr, delta_ptr, pos_ptr,
                     slot_map_ptr, mpos_ptr, seq_lens_ptr, table_ptr, num_tokens, num_reqs,
                     pages, stride_pool, page_size, row_programs,
                     BLOCK_ROWS: tl.constexpr, BLOCK_REQS: tl.constexpr, CHUNK: tl.constexpr,
                     PAGES_PAD: tl.constexpr, MROPE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid < row_programs:
        _row_metadata(qsl_ptr, ctx_ptr, slots_ptr, pool_table_ptr, delta_ptr, pos_ptr,
                      slot_map_ptr, mpos_ptr, num_tokens, num_reqs, stride_pool, page_size, pid,
                      BLOCK_ROWS, CHUNK, MROPE)
    else:
        _request_metadata(qsl_ptr, ctx_ptr, slots_ptr, pool_table_ptr, seq_lens_ptr, table_ptr,
                          num_reqs, pages, stride_pool, pid - row_programs, BLOCK_REQS,
                          PAGES_PAD)


def device_metadata_triton(query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                           slots: torch.Tensor, pool_table: torch.Tensor, page_size: int,
                           num_tokens: int, mrope_deltas: torch.Tensor | None = None
                           ) -> dict[str, torch.Tensor]:
    """``VerifierState.device_metadata`` in one launch: ``positions`` (int64 [N]),
    ``seq_lens`` (int32 [R]), ``block_table`` ([R, pages], the pool table's rows of
    ``slots``), ``slot_mapping`` (int64 [N]) and, with ``mrope_deltas``, ``mrope_positions``
    (int64 [3, N], one row expanded). Inputs are int32 device tensors (``query_start_loc``
    [R+1], the others [R]); the caller has checked the layout."""
    r = context_lens.shape[0]
    dev = query_start_loc.device
    for name, t, size in (("query_start_loc", query_start_loc, r + 1),
                          ("context_lens", context_lens, r), ("slots", slots, r)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != size or t.device != dev \
                or not t.is_contiguous():
            raise ValueError(f"device_metadata_triton: {name} is {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}; it must be contiguous int32 "
                             f"[{size}] on {dev}")
    if r == 0:
        raise ValueError("device_metadata_triton: 0 requests; a batch has at least one (padded "
                         "slots count)")
    pages = pool_table.shape[1]
    positions = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(r, dtype=torch.int32, device=dev)
    table = torch.empty(r, pages, dtype=pool_table.dtype, device=dev)
    mrope = mrope_deltas is not None
    mpos = torch.empty(num_tokens, dtype=torch.int64, device=dev) if mrope else positions
    row_programs = triton.cdiv(num_tokens, BLOCK_ROWS)
    pdl = use_pdl(dev, device_target(dev)[0])
    launch(_metadata_kernel, (row_programs + triton.cdiv(r, BLOCK_REQS),),
        query_start_loc, context_lens, slots, pool_table,
        mrope_deltas if mrope else context_lens, positions, slot_mapping, mpos, seq_lens, table,
        num_tokens, r, pages, pool_table.stride(0), page_size, row_programs,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_REQS=BLOCK_REQS, CHUNK=CHUNK,
        PAGES_PAD=triton.next_power_of_2(max(pages, 1)), MROPE=mrope, PDL=pdl, num_warps=4,
        **pdl_options(pdl))
    if warming():  # the launch did not run; the batch is all padding (TierGraphs): position 0,
        for t in (positions, seq_lens, table, mpos):  # no KV slot, no context
            t.zero_()
        slot_mapping.fill_(-1)
    out = {"positions": positions, "seq_lens": seq_lens, "block_table": table,
           "slot_mapping": slot_mapping, "query_start_loc": query_start_loc, "slots": slots}
    if mrope:
        out["mrope_positions"] = mpos.expand(3, num_tokens)  # one row, as the torch version
    return out
