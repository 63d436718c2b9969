"""Triton rotary embedding (NeoX / HF ``rotate_half`` style) on flat positions.

Kernel first, then the launch plan and the host wrapper (the Triton tutorials' order). The
oracle is HF transformers' ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` (text) and the
Qwen2-VL / Qwen3-VL text rotary classes (mRoPE); ``tests/test_triton_rotary.py`` mirrors them.

One launch rotates packed ``q [N, H, D]`` and ``k [N, Hkv, D]``; the grid is
``(cdiv(N, BLOCK_N), cdiv(H, BLOCK_H) + cdiv(Hkv, BLOCK_H))`` from shapes only (no host sync,
CUDA-graph safe):

- Axis 1 enumerates head blocks of q, then of k: a program picks its tensor (pointers and
  strides) with one scalar branch and runs the same code for both.
- A program loads the positions of its ``BLOCK_N`` tokens (one row for text; three for mRoPE,
  joined per frequency by selects), and computes ``cos``/``sin`` of ``pos * inv_freq`` in
  fp32 once for its ``[BLOCK_N, D/2]`` angles, shared by its ``BLOCK_H`` heads.
- The ``[BLOCK_N, BLOCK_H, D/2]`` tile is read as its two halves ``x1 = x[:D/2]``,
  ``x2 = x[D/2:]``: ``out1 = x1*cos - x2*sin``, ``out2 = x2*cos + x1*sin`` (that is
  ``x*cos + rotate_half(x)*sin`` with ``cos``/``sin`` repeated over the two halves).
- mRoPE: frequency ``f`` reads position row ``row(f)``. Chunked (Qwen2-VL, Qwen2.5-VL):
  the sections lie one after the other, ``row = (f >= s0) + (f >= s0 + s1)``. Interleaved
  (Qwen3-VL, HF's ``recomposition_frequencies``): row 1 where ``f % 3 == 1 and f < 3*s1``,
  row 2 where ``f % 3 == 2 and f < 3*s2``, else row 0.

Numerics (chosen to match HF eager bit for bit where the cosines agree): the angle is the
fp32 product ``float(pos) * inv_freq``; ``cos``/``sin`` are fp32 (libdevice / ocml, not the
approximate instructions), times ``attention_scaling``, then cast to the activation dtype as
HF's rotary module returns them. Each product is rounded to the activation dtype, then the
sum, as HF's eager ``q * cos + rotate_half(q) * sin`` does in bf16/fp16 (PyTorch computes a
bf16 op in fp32 and rounds once, as here). Fused multiply-add is disabled
(``enable_fp_fusion=False``; the PTX then has ``mul.rn``/``sub.rn``, no ``fma`` outside
libdevice) so float32 rounds each product too. Inductor by default keeps a pointwise chain's
bf16 intermediates in fp32 and rounds at the store, so it differs from HF eager (and from this
kernel) by about one ulp of the activation dtype. bf16 rounding is done on the integer bits
(see ``round_to``) so the CPU interpreter, whose cast truncates, gives the GPU's bits.

Tiles (``plan_rotary``) are a first guess, not yet timed on a GPU:
``benchmarks/rotary.py --sweep`` times the others.

``out_q is q`` (in place) is allowed: every program reads its tile before writing it, and no
other program touches it. Other overlaps between inputs and outputs are not allowed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import launch
from .pdl import pdl_enter, pdl_options, use_pdl
from .device import device_target
from .device import device_sm_count

__all__ = ["RotaryPlan", "plan_rotary", "rotary_triton", "rotary_apply_triton", "check_rotary"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_POS_DTYPES = (torch.int32, torch.int64)
_TILE_MAX = 1024  # elements of one half-tile (BLOCK_N x BLOCK_H x D/2): 4 KB of bf16 read in all
_MIN_HEADS = 4  # head blocks are not split below 4 heads to make more programs
_ELEMS_PER_THREAD = 8  # one 16-byte vector of bf16 per thread and load


@triton.jit
def _freq_rows(f, MROPE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    """Position row of each frequency index ``f`` (0 for text)."""
    if MROPE == 1:  # chunked: sections one after the other
        return (f >= S0).to(tl.int32) + (f >= S0 + S1).to(tl.int32)
    elif MROPE == 2:  # interleaved: T H W T H W ..., H and W stop at 3*s1, 3*s2
        return tl.where((f % 3 == 1) & (f < 3 * S1), 1, tl.where((f % 3 == 2) & (f < 3 * S2), 2, 0))
    else:
        return f * 0


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (to nearest, ties to even), kept in fp32.

    bf16 is rounded by integer arithmetic on the fp32 bits: the GPU's ``cvt.rn`` gives the same
    result, but the interpreter's cast truncates, and the CPU tests compare bit for bit."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def rotate_halves(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """``(x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)`` of a head's halves, each product rounded to
    ``dtype``, then the sum (HF eager's ``x * cos + rotate_half(x) * sin``); kept in fp32."""
    o1 = round_to(round_to(x1 * c1, dtype) - round_to(x2 * s1, dtype), dtype)
    o2 = round_to(round_to(x2 * c2, dtype) + round_to(x1 * s2, dtype), dtype)
    return o1, o2


@triton.jit
def _cos_sin(pos_ptr, inv_freq_ptr, tokens, tok_ok, pos_stride_row, pos_stride_tok, scaling,
             HALF: tl.constexpr, HALF_PAD: tl.constexpr, MROPE: tl.constexpr, S0: tl.constexpr,
             S1: tl.constexpr, S2: tl.constexpr):
    """fp32 ``cos``/``sin`` ``[BLOCK_N, HALF_PAD]`` of ``float(pos) * inv_freq``, scaled."""
    f = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + f, mask=f < HALF, other=0.0)  # [HALF_PAD] fp32
    p_ptrs = pos_ptr + tokens * pos_stride_tok
    pos = tl.load(p_ptrs, mask=tok_ok, other=0)[:, None]  # [BLOCK_N, 1]
    if MROPE != 0:
        row = _freq_rows(f, MROPE, S0, S1, S2)[None, :]  # [1, HALF_PAD]
        p1 = tl.load(p_ptrs + pos_stride_row, mask=tok_ok, other=0)[:, None]
        p2 = tl.load(p_ptrs + 2 * pos_stride_row, mask=tok_ok, other=0)[:, None]
        pos = tl.where(row == 1, p1, tl.where(row == 2, p2, pos))  # [BLOCK_N, HALF_PAD]
    angle = pos.to(tl.float32) * inv_freq[None, :]
    return tl.cos(angle) * scaling, tl.sin(angle) * scaling


@triton.jit
def _rotary_kernel(
        q_ptr, k_ptr, out_q_ptr, out_k_ptr, pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, num_tokens,
        num_q_heads, num_k_heads, q_head_blocks, stride_q_tok, stride_q_head, stride_k_tok,
        stride_k_head, stride_oq_tok, stride_oq_head, stride_ok_tok, stride_ok_head,
        pos_stride_row, pos_stride_tok, cos_stride_tok, sin_stride_tok, scaling,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr, MROPE: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
        S2: tl.constexpr, GIVEN: tl.constexpr, PDL: tl.constexpr):
    """``BLOCK_N`` tokens x ``BLOCK_H`` heads of q (head blocks first) or of k. ``GIVEN``: read
    ``cos``/``sin [N, D]`` as the model's rotary module made them (``dspark::rotary_apply``;
    their two halves are read apart), else compute them from the positions. ``PDL``: launched
    with programmatic dependent launch (``kernels/pdl.py``)."""
    pdl_enter(PDL)
    dtype = out_q_ptr.dtype.element_ty
    tokens = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N]
    tok_ok = tokens < num_tokens
    block = tl.program_id(1)
    if block < q_head_blocks:
        x_ptr, o_ptr, num_heads, head0 = q_ptr, out_q_ptr, num_q_heads, block * BLOCK_H
        s_tok, s_head, so_tok, so_head = stride_q_tok, stride_q_head, stride_oq_tok, stride_oq_head
    else:
        x_ptr, o_ptr, num_heads = k_ptr, out_k_ptr, num_k_heads
        head0 = (block - q_head_blocks) * BLOCK_H
        s_tok, s_head, so_tok, so_head = stride_k_tok, stride_k_head, stride_ok_tok, stride_ok_head
    f = tl.arange(0, HALF_PAD)
    if GIVEN:
        cs_ok = tok_ok[:, None] & (f < HALF)[None, :]
        c_ptrs = cos_ptr + tokens[:, None] * cos_stride_tok + f[None, :]
        s_ptrs = sin_ptr + tokens[:, None] * sin_stride_tok + f[None, :]
        c1 = tl.load(c_ptrs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
        c2 = tl.load(c_ptrs + HALF, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
        s1 = tl.load(s_ptrs, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
        s2 = tl.load(s_ptrs + HALF, mask=cs_ok, other=0.0).to(tl.float32)[:, None, :]
    else:
        cos, sin = _cos_sin(pos_ptr, inv_freq_ptr, tokens, tok_ok, pos_stride_row,
                            pos_stride_tok, scaling, HALF, HALF_PAD, MROPE, S0, S1, S2)
        # HF's rotary module returns cos/sin in the activation dtype: round them the same way
        c1 = round_to(cos, dtype)[:, None, :]  # [BLOCK_N, 1, HALF_PAD]
        s1 = round_to(sin, dtype)[:, None, :]
        c2 = c1
        s2 = s1
    heads = head0 + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    ok = tok_ok[:, None, None] & (heads < num_heads)[None, :, None] & (f < HALF)[None, None, :]
    x_offs = tokens[:, None, None] * s_tok + heads[None, :, None] * s_head + f[None, None, :]
    x1 = tl.load(x_ptr + x_offs, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_H, HALF_PAD]
    x2 = tl.load(x_ptr + x_offs + HALF, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, c1, c2, s1, s2, dtype)
    o_offs = tokens[:, None, None] * so_tok + heads[None, :, None] * so_head + f[None, None, :]
    tl.store(o_ptr + o_offs, o1.to(dtype), mask=ok)
    tl.store(o_ptr + o_offs + HALF, o2.to(dtype), mask=ok)


@dataclass(frozen=True)
class RotaryPlan:
    """Tiles of the rotary launch, derived from shapes and the device only."""

    block_n: int
    """Tokens per program (a power of two)."""
    block_h: int
    """Heads per program, of q or of k (a power of two)."""
    num_warps: int
    """Warps per program."""


@functools.lru_cache(maxsize=1024)
def plan_rotary(num_tokens: int, num_q_heads: int, num_k_heads: int, head_dim: int,
                sm_count: int) -> RotaryPlan:
    """Tiles from host ints. ``BLOCK_H`` covers the larger head count (at most ``_TILE_MAX``
    elements per half-tile); while there are fewer programs than multiprocessors it halves,
    down to ``_MIN_HEADS``, so a verify step of a few tokens still spreads its loads. With
    programs to spare, ``BLOCK_N`` doubles while the half-tile stays within ``_TILE_MAX``."""
    half_pad = triton.next_power_of_2(max(head_dim // 2, 1))
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads, 1)),
                  max(1, _TILE_MAX // half_pad))
    n = max(num_tokens, 1)

    def programs(bn: int, bh: int) -> int:
        return triton.cdiv(n, bn) * (triton.cdiv(num_q_heads, bh) + triton.cdiv(num_k_heads, bh))

    while block_h > _MIN_HEADS and programs(1, block_h) < sm_count:
        block_h //= 2
    block_n = 1
    while 2 * block_n * block_h * half_pad <= _TILE_MAX and \
            programs(2 * block_n, block_h) >= 4 * sm_count:
        block_n *= 2
    elems = block_n * block_h * half_pad
    num_warps = max(1, min(8, elems // (_ELEMS_PER_THREAD * 32)))
    return RotaryPlan(block_n, block_h, num_warps)


def _fail(name: str, value, rule: str, owner: str = "rotary_triton") -> ValueError:
    return ValueError(f"{owner}: {name} is {value}; {rule}")


def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    return f"{tuple(t.shape)} {t.dtype} on {t.device}, strides {tuple(t.stride())}"


def _check_activation(name: str, t, like: torch.Tensor | None, n: int | None, d: int | None):
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in _DTYPES:
        raise _fail(name, _desc(t), "it must be a 3-D [N, heads, D] float32, bfloat16 or "
                    "float16 tensor")
    if like is not None and (t.dtype != like.dtype or t.device != like.device or
                             t.shape[0] != n or t.shape[2] != d):
        raise _fail(name, _desc(t), f"it must have q's dtype and device ({like.dtype} on "
                    f"{like.device}), N = {n} and D = {d}")
    if t.shape[1] < 1 or (t.numel() and t.stride(2) != 1):
        raise _fail(name, _desc(t), "it needs at least one head and a dense last dim "
                    "(stride 1); call .contiguous() first")


def check_rotary(q, k, positions, inv_freq, mrope_section, mrope_interleaved,
                 attention_scaling, out_q, out_k) -> tuple[int, int, int]:
    """Validate on the host (shapes, dtypes, devices; no tensor values, so no sync).
    Returns the position mode (0 text, 1 chunked mRoPE, 2 interleaved) and the first two
    sections (0 for text). Raises ValueError naming the argument, its value and the rule."""
    _check_activation("q", q, None, None, None)
    n, _, d = q.shape
    if d < 2 or d % 2:
        raise _fail("q", _desc(q), "the head dim D must be even (rotate_half splits it)")
    _check_activation("k", k, q, n, d)
    half = d // 2
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dtype != torch.float32 or \
            inv_freq.shape != (half,) or inv_freq.device != q.device or inv_freq.stride(0) != 1:
        raise _fail("inv_freq", _desc(inv_freq), f"it must be a contiguous float32 [D/2] = "
                    f"[{half}] tensor on {q.device} (HF's rotary_emb.inv_freq)")
    if not isinstance(attention_scaling, (int, float)) or isinstance(attention_scaling, bool) \
            or not math.isfinite(attention_scaling):
        raise _fail("attention_scaling", repr(attention_scaling), "it must be a finite Python "
                    "float (HF's rotary_emb.attention_scaling)")
    if not isinstance(mrope_interleaved, bool):
        raise _fail("mrope_interleaved", repr(mrope_interleaved), "it must be a bool")
    mode, sections = _check_sections(mrope_section, mrope_interleaved, half)
    want = (n,) if mode == 0 else (3, n)
    if not isinstance(positions, torch.Tensor) or positions.dtype not in _POS_DTYPES or \
            tuple(positions.shape) != want or positions.device != q.device:
        what = "text rotary (mrope_section=None)" if mode == 0 else "mRoPE"
        raise _fail("positions", _desc(positions), f"{what} takes an int32 or int64 "
                    f"{list(want)} tensor on {q.device}")
    for name, out, like in (("out_q", out_q, q), ("out_k", out_k, k)):
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != like.shape or
                                out.dtype != like.dtype or out.device != like.device or
                                (out.numel() and out.stride(2) != 1)):
            raise _fail(name, _desc(out), f"it must match {name[-1]} ({_desc(like)}) with a "
                        "dense last dim")
    return mode, sections[0], sections[1]


def _check_sections(mrope_section, interleaved: bool, half: int) -> tuple[int, tuple]:
    if mrope_section is None:
        if interleaved:
            raise _fail("mrope_interleaved", True, "it needs mrope_section (3 ints)")
        return 0, (0, 0, 0)
    sec = tuple(mrope_section) if isinstance(mrope_section, (tuple, list)) else None
    if sec is None or len(sec) != 3 or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sec) or \
            sum(sec) != half:
        raise _fail("mrope_section", repr(mrope_section), f"it must be 3 non-negative ints "
                    f"(temporal, height, width) summing to D/2 = {half}")
    return (2 if interleaved else 1), sec


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, mrope_section: tuple[int, int, int] | None = None,
                  out_q: torch.Tensor | None = None, out_k: torch.Tensor | None = None, *,
                  mrope_interleaved: bool = False, attention_scaling: float = 1.0,
                  plan: RotaryPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate packed ``q [N, H, D]`` and ``k [N, Hkv, D]`` by their positions, one launch.

    ``positions``: int32/int64 ``[N]`` (text) or ``[3, N]`` with ``mrope_section`` (temporal,
    height, width frequencies, summing to ``D/2``; ``mrope_interleaved`` picks Qwen3-VL's
    layout over Qwen2-VL's chunks). ``inv_freq``: float32 ``[D/2]``. ``attention_scaling``
    multiplies cos and sin (HF's ``rotary_emb.attention_scaling``). ``out_q``/``out_k``:
    optional outputs (may be ``q``/``k`` themselves: in place). ``plan`` overrides the tiles.
    No host sync: CUDA-graph safe. Returns ``(q_rotated, k_rotated)`` in q's dtype.
    """
    mode, s0, s1 = check_rotary(q, k, positions, inv_freq, mrope_section, mrope_interleaved,
                                attention_scaling, out_q, out_k)
    out_q = torch.empty_like(q) if out_q is None else out_q
    out_k = torch.empty_like(k) if out_k is None else out_k
    n, h, d = q.shape
    hkv = k.shape[1]
    if n == 0:
        return out_q, out_k
    plan = plan or plan_rotary(n, h, hkv, d, device_sm_count(q.device))
    pdl = _pdl(q.device)
    q_blocks = triton.cdiv(h, plan.block_h)
    grid = (triton.cdiv(n, plan.block_n), q_blocks + triton.cdiv(hkv, plan.block_h))
    pos_row = positions.stride(0) if mode else 0
    launch(_rotary_kernel, grid,
        q, k, out_q, out_k, positions, inv_freq, q, q, n, h, hkv, q_blocks, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), out_q.stride(0), out_q.stride(1),
        out_k.stride(0), out_k.stride(1), pos_row, positions.stride(-1), 0, 0,
        float(attention_scaling), HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
        BLOCK_N=plan.block_n, BLOCK_H=plan.block_h, MROPE=mode, S0=s0, S1=s1,
        S2=(d // 2 - s0 - s1) if mode else 0, GIVEN=False, PDL=pdl,
        num_warps=plan.num_warps, enable_fp_fusion=False, **pdl_options(pdl))
    return out_q, out_k


_APPLY = "rotary_apply_triton"


def _pdl(device: torch.device) -> bool:
    return use_pdl(device, device_target(device)[0])


def rotary_apply_triton(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, out: list | None = None) -> list[torch.Tensor]:
    """Triton ``dspark::rotary_apply``: ``[x * cos + rotate_half(x) * sin, the same for y]``
    for a layer's q ``x [N, Hx, D]`` and k ``y [N, Hy, D]`` (any strides with a dense last dim)
    with ``cos``/``sin [N, D]`` as the model's rotary module made them; contiguous outputs in
    the inputs' dtype, with HF eager's roundings (the reference op's). One launch, no host
    sync. ``out``: ``[x_out, y_out]`` to write instead (each may be its input itself: every
    program reads its tile before writing it; the skinny matmul's rotary past its rows)."""
    for name, t, dims in (("x", x, 3), ("y", y, 3), ("cos", cos, 2), ("sin", sin, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.stride(-1) != 1:
            raise _fail(name, _desc(t), f"it must be a {dims}-D tensor with a dense last dim",
                        _APPLY)
        if t.device != x.device:
            raise _fail(name, f"on {t.device}", f"x is on {x.device}; move it there", _APPLY)
    n, hx, d = x.shape
    if y.shape[0] != n or y.shape[2] != d or y.dtype != x.dtype or d % 2:
        raise _fail("y", _desc(y), f"it needs x's N and head dim ({n}, {d}, even) and dtype "
                                   f"{x.dtype}", _APPLY)
    if cos.shape != (n, d) or sin.shape != (n, d):
        raise _fail("cos/sin", f"{tuple(cos.shape)} / {tuple(sin.shape)}",
                    f"both must be [N, D] = {(n, d)}", _APPLY)
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (x, y)] \
        if out is None else list(out)
    for t, o in zip((x, y), outs):
        if o.shape != t.shape or o.dtype != t.dtype or o.stride(-1) != 1:
            raise _fail("out", _desc(o), f"each must be like its input {_desc(t)}", _APPLY)
    if n == 0:
        return outs
    hy = y.shape[1]
    plan = plan_rotary(n, hx, hy, d, device_sm_count(x.device))
    pdl = _pdl(x.device)
    x_blocks = triton.cdiv(hx, plan.block_h)
    grid = (triton.cdiv(n, plan.block_n), x_blocks + triton.cdiv(hy, plan.block_h))
    launch(_rotary_kernel, grid,
        x, y, outs[0], outs[1], cos, cos, cos, sin, n, hx, hy, x_blocks, x.stride(0),
        x.stride(1), y.stride(0), y.stride(1), outs[0].stride(0), outs[0].stride(1),
        outs[1].stride(0), outs[1].stride(1), 0, 0, cos.stride(0), sin.stride(0), 1.0,
        HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), BLOCK_N=plan.block_n,
        BLOCK_H=plan.block_h, MROPE=0, S0=0, S1=0, S2=0, GIVEN=True, PDL=pdl,
        num_warps=plan.num_warps, enable_fp_fusion=False, **pdl_options(pdl))
    return outs
