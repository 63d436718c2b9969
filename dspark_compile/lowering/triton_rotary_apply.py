"""Triton lowering of ``dspark::rotary_apply``: the rotation of a layer's q and k by a step's
``cos``/``sin``, one launch.

``out = x * cos + rotate_half(x) * sin`` per head, with ``cos``/``sin [N, D]`` as the model's
rotary module made them (text or mRoPE, already scaled and in their dtype); HF's
``rotate_half(x) = cat(-x[D/2:], x[:D/2])``. The grid is ``(cdiv(N, BLOCK_N), cdiv(Hx, BLOCK_H)
+ cdiv(Hy, BLOCK_H))``: head blocks of ``x`` then of ``y``, each program loading its tokens'
``cos``/``sin`` once for ``BLOCK_H`` heads. Math in fp32, one rounding at the store (as
Inductor's fused kernel does). The oracle is :func:`dspark_compile.lowering.ops.rotary_apply`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotary_apply_triton"]

_BLOCK_N = 16


@triton.jit(do_not_specialize=["n"])
def _rotary_apply_kernel(x_ptr, y_ptr, cos_ptr, sin_ptr, xo_ptr, yo_ptr, n, stride_xn, stride_xh,
                         stride_yn, stride_yh, stride_cn, stride_sn, hx, hy,
                         HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    pid_h = tl.program_id(1)
    x_blocks = tl.cdiv(hx, BLOCK_H)
    if pid_h < x_blocks:  # one scalar branch picks the tensor; the code below serves both
        in_ptr = x_ptr
        out_ptr = xo_ptr
        heads_n = hx
        s_n = stride_xn
        s_h = stride_xh
        h0 = pid_h
    else:
        in_ptr = y_ptr
        out_ptr = yo_ptr
        heads_n = hy
        s_n = stride_yn
        s_h = stride_yh
        h0 = pid_h - x_blocks
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    heads = h0 * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH]
    d = tl.arange(0, HALF_PAD)  # [HP]
    row_ok = rows < n
    d_ok = d < HALF
    cs_mask = row_ok[:, None] & d_ok[None, :]
    r64 = rows.to(tl.int64)
    c1 = tl.load(cos_ptr + r64[:, None] * stride_cn + d[None, :], mask=cs_mask).to(tl.float32)
    c2 = tl.load(cos_ptr + r64[:, None] * stride_cn + HALF + d[None, :], mask=cs_mask)
    s1 = tl.load(sin_ptr + r64[:, None] * stride_sn + d[None, :], mask=cs_mask).to(tl.float32)
    s2 = tl.load(sin_ptr + r64[:, None] * stride_sn + HALF + d[None, :], mask=cs_mask)
    c2 = c2.to(tl.float32)
    s2 = s2.to(tl.float32)
    mask = row_ok[:, None, None] & (heads < heads_n)[None, :, None] & d_ok[None, None, :]
    base = r64[:, None, None] * s_n + heads[None, :, None].to(tl.int64) * s_h + d[None, None, :]
    x1 = tl.load(in_ptr + base, mask=mask).to(tl.float32)
    x2 = tl.load(in_ptr + base + HALF, mask=mask).to(tl.float32)
    o1 = x1 * c1[:, None, :] - x2 * s1[:, None, :]
    o2 = x2 * c2[:, None, :] + x1 * s2[:, None, :]
    out = (r64[:, None, None] * heads_n + heads[None, :, None]) * (2 * HALF) + d[None, None, :]
    tl.store(out_ptr + out, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + out + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _fail(msg: str) -> None:
    raise ValueError(f"rotary_apply_triton: {msg}")


def rotary_apply_triton(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> list[torch.Tensor]:
    """``[x * cos + rotate_half(x) * sin, the same for y]``: ``x [N, Hx, D]``, ``y [N, Hy,
    D]`` (any strides with a dense last dim), ``cos``/``sin [N, D]``; contiguous outputs in
    the inputs' dtype. No host sync; CUDA-graph safe."""
    for name, t, dims in (("x", x, 3), ("y", y, 3), ("cos", cos, 2), ("sin", sin, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.stride(-1) != 1:
            _fail(f"{name} is {getattr(t, 'shape', type(t).__name__)}; it must be a {dims}-D "
                  "tensor with a dense last dim")
        if t.device != x.device:
            _fail(f"{name} is on {t.device}, x on {x.device}")
    n, _, d = x.shape
    if y.shape[0] != n or y.shape[2] != d or y.dtype != x.dtype or d % 2:
        _fail(f"x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} need the same N, "
              "an even head dim D and one dtype")
    if cos.shape != (n, d) or sin.shape != (n, d):
        _fail(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [N, D] = "
              f"{(n, d)}")
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (x, y)]
    if n == 0:
        return outs
    half = d // 2
    half_pad = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(x.shape[1], y.shape[1])),
                         2048 // (_BLOCK_N * half_pad)))
    grid = (triton.cdiv(n, _BLOCK_N),
            triton.cdiv(x.shape[1], block_h) + triton.cdiv(y.shape[1], block_h))
    _rotary_apply_kernel[grid](
        x, y, cos, sin, outs[0], outs[1], n, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        cos.stride(0), sin.stride(0), x.shape[1], y.shape[1], HALF=half,
        HALF_PAD=half_pad, BLOCK_N=_BLOCK_N, BLOCK_H=block_h, num_warps=4)
    return outs
