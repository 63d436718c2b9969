"""Packed rows into paged pools: the store launch of the ops that write per-token state before
they read it (``compress``'s raw ``kv`` / ``gate`` rows, ``sparse_attention``'s K and V,
``sparse_index``'s indexer keys). No host sync; the grid comes from shapes only.

``_store_rows_kernel``, grid ``(N, column blocks)``: program ``(t, c)`` copies columns ``c *
BLOCK_W ..`` of packed row ``t`` of ``a`` (and of ``b`` with ``TWO``) into pool row
``slot_mapping[t]`` (nothing for a slot < 0), cast to the pool's dtype rounded to nearest as
torch's cast does (``rotary.round_to``: the interpreter's own cast truncates). A source row is
dense (its channels contiguous); rows may be strided (a slice of a wider projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .rotary import round_to

__all__ = ["store_rows_triton"]

STORE_BLOCK = 1024
"""Columns of one row a store program writes."""


@triton.jit
def _store_block(src_ptr, dst_ptr, row, stride, slot, width, cols, ok):
    """Columns ``cols`` (where ``ok``) of row ``row`` of ``src`` (rows ``stride`` apart) into
    row ``slot`` of ``dst [rows, width]``, cast to ``dst``'s dtype (rounded to nearest)."""
    dst_ty = dst_ptr.dtype.element_ty
    x = tl.load(src_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_ptr + slot * width + cols, round_to(x, dst_ty).to(dst_ty), mask=ok)


@triton.jit
def _store_rows_kernel(a_src_ptr, a_dst_ptr, a_width, a_stride, b_src_ptr, b_dst_ptr, b_width,
                       b_stride, slot_mapping_ptr, BLOCK_W: tl.constexpr, TWO: tl.constexpr):
    """Row ``program_id(0)`` of ``a_src`` (and of ``b_src`` with ``TWO``) into pool row
    ``slot_mapping[row]`` of ``a_dst`` (``b_dst``), columns ``program_id(1) * BLOCK_W ..``;
    nothing for a slot < 0."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    live = (cols * 0 + slot) >= 0  # a [BLOCK_W] mask (the interpreter needs the broadcast)
    _store_block(a_src_ptr, a_dst_ptr, row, a_stride, slot, a_width, cols,
                 live & (cols < a_width))
    if TWO:
        _store_block(b_src_ptr, b_dst_ptr, row, b_stride, slot, b_width, cols,
                     live & (cols < b_width))


def store_rows_triton(src: torch.Tensor, dst: torch.Tensor, slot_mapping: torch.Tensor,
                      src_b: torch.Tensor | None = None,
                      dst_b: torch.Tensor | None = None) -> None:
    """Row ``i`` of ``src [N, ...]`` into flat row ``slot_mapping[i]`` of the paged pool ``dst
    [pages, page_size, ...]`` (a slot < 0: nothing), cast to ``dst``'s dtype; with ``src_b``
    and ``dst_b``, the same for that pair in the same launch. The caller has checked shapes and
    devices; pools are contiguous and each source row dense."""
    n = src.shape[0]
    if n == 0:
        return
    a_width = src[0].numel()
    b_width = src_b[0].numel() if src_b is not None else 0
    block_w = min(STORE_BLOCK, triton.next_power_of_2(max(a_width, b_width, 1)))
    blocks = triton.cdiv(max(a_width, b_width, 1), block_w)
    two = src_b is not None
    launch(_store_rows_kernel, (n, blocks), src, dst, a_width, src.stride(0),
           src_b if two else src, dst_b if two else dst, b_width,
           src_b.stride(0) if two else 0, slot_mapping, BLOCK_W=block_w, TWO=two,
           num_warps=4)
