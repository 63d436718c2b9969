"""Triton lowering of the device-side token-id guard (``session.ids.DeviceIdGuard.guard``).

A verify step on device ids clamps them into the vocabulary and records, per slot, the first
out-of-vocabulary row of its request and that row's id (read at commit). As torch ops that is
about fifteen small launches (a search, a scatter-min, gathers, index copies): at bs 1 they
added about 4% to a 1.1B model's tier-graph step on the H200. This is one launch with the same
results:

- program ``r < R`` walks request ``r``'s rows ``qsl[r] .. qsl[r + 1] - 1`` in blocks of
  ``BLOCK``, writes them clamped, and (if the request has rows) stores at its slot ``1 + the
  first bad local row`` (0: none) and that row's id (0: none);
- program ``R`` clamps the padding rows ``qsl[R] .. N - 1`` and records nothing.

No host sync: it runs inside a CUDA graph. The oracle is the torch-op version
(``DeviceIdGuard.guard_reference``); ``tests/kernels/test_triton_ids.py`` compares them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, warming

__all__ = ["ids_guard_triton"]

BLOCK = 128


@triton.jit
def _ids_guard_kernel(ids_ptr, out_ptr, qsl_ptr, slots_ptr, flags_ptr, num_tokens,
                      num_requests, flag_stride, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    none = tl.zeros((), dtype=tl.int64) + num_tokens  # "no bad row" (N: past every row)
    start = tl.load(qsl_ptr + r).to(tl.int64)
    if r < num_requests:
        end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    else:
        end = none
    first = none
    token = tl.zeros((), dtype=tl.int64)
    offs = tl.arange(0, BLOCK)
    for off in range(start, end, BLOCK):
        rows = off + offs
        ok = rows < end
        x = tl.load(ids_ptr + rows, mask=ok, other=0).to(tl.int64)
        bad = ok & ((x < 0) | (x >= vocab))
        local = tl.where(bad, rows - start, none)
        block_first = tl.min(local, axis=0)
        block_token = tl.sum(tl.where(local == block_first, x, 0), axis=0)
        take = (first == none) & (block_first < none)
        first = tl.where(take, block_first, first)
        token = tl.where(take, block_token, token)
        tl.store(out_ptr + rows, tl.minimum(tl.maximum(x, 0), vocab - 1).to(
            out_ptr.dtype.element_ty), mask=ok)
    if (r < num_requests) & (end > start):
        slot = tl.load(slots_ptr + r).to(tl.int64)
        hit = first < none
        tl.store(flags_ptr + slot, tl.where(hit, first + 1, 0))
        tl.store(flags_ptr + flag_stride + slot, tl.where(hit, token, 0))


def ids_guard_triton(input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                     slots: torch.Tensor, flags: torch.Tensor, vocab: int) -> torch.Tensor:
    """Clamped ``input_ids [N]``; ``flags [2, S]`` int64 gets, at each request's slot, ``1 +``
    its first out-of-vocabulary row (0: none) and that row's id. One launch of ``R + 1``
    programs, ``R = query_start_loc.numel() - 1``."""
    out = torch.empty_like(input_ids)
    num_requests = query_start_loc.numel() - 1
    launch(_ids_guard_kernel, (num_requests + 1,), input_ids, out, query_start_loc, slots,
           flags, input_ids.shape[0], num_requests, flags.stride(0), vocab, BLOCK=BLOCK)
    if warming():  # compile-ahead compiled the kernel without running it: the ids the forward
        return out.zero_()  # reads must still be in the vocabulary (id 0), as padding is
    return out
