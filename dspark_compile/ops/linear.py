"""Token-wise linear ops the lowering passes introduce: ``dspark::linear_group`` (matmuls
that read the same rows), ``dspark::rotary_apply`` (a layer's q/k rotation) and
``dspark::skinny_linear`` (a matmul with its norm or SiLU-and-mul and residual add); schema,
fake and reference (the ops the model's own graph ran, in order).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["linear_group", "rotary_apply", "skinny_linear", "skinny_linear_fake", "rotate"]


@torch.library.custom_op("dspark::linear_group", mutates_args=())
def linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]``: matmuls by weights that read the same rows ``x [M, K]``
    (each ``w [N_i, K]``), one node; the reference is ``torch.mm`` per weight."""
    return [torch.mm(x, w.t()) for w in weights]


@linear_group.register_fake
def _(x, weights):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos[:, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[:, None]


@torch.library.custom_op("dspark::rotary_apply", mutates_args=())
def rotary_apply(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> list[torch.Tensor]:
    """HF's ``q * cos + rotate_half(q) * sin`` for a layer's q ``x [N, Hx, D]`` and k ``y [N, Hy,
    D]`` with ``cos``/``sin [N, D]``, one node; the reference is that math in the inputs' dtype
    (the ops the model's own graph ran)."""
    return [rotate(x, cos, sin), rotate(y, cos, sin)]


@rotary_apply.register_fake
def _(x, y, cos, sin):
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(y.shape, dtype=y.dtype, device=y.device)]


@torch.library.custom_op("dspark::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                  gamma: Optional[torch.Tensor], eps: float, glu: bool,
                  residual: Optional[torch.Tensor],
                  glu_out: bool, cos: Optional[torch.Tensor] = None,
                  sin: Optional[torch.Tensor] = None,
                  rot_cols: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)``: ``y = a @ w.T + bias`` (``glu_out``: ``silu(y[:, :N]) * y[:, N:]`` of
    ``w [2N, K]``) with ``a`` = ``x``, or ``silu(x[:, :K]) * x[:, K:]`` (``glu``), or HF's
    RMSNorm by ``gamma`` and ``eps`` of ``h = x + residual`` (or of ``x``); ``h`` is returned
    when a residual is given, else an empty tensor (``passes/fuse_linear.py``). With
    ``rot_cols`` > 0, the first ``rot_cols`` columns of ``y`` are heads of ``D =
    cos.shape[1]`` rotated as ``dspark::rotary_apply`` does with ``cos``/``sin [M, D]``
    (``fuse_rotary_epilogue``). The reference is the ops the model's graph ran, in order."""
    k = w.shape[1]
    h = x.new_empty((0,))
    if glu:
        a = torch.nn.functional.silu(x[:, :k]) * x[:, k:]
    elif gamma is not None:
        if residual is not None:
            x = h = x + residual
        h32 = x.to(torch.float32)
        a = gamma * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    else:
        a = x
    y = torch.mm(a, w.t()) if bias is None else torch.addmm(bias, a, w.t())
    if glu_out:
        n = w.shape[0] // 2
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    if rot_cols:
        heads = y[:, :rot_cols].unflatten(1, (-1, cos.shape[1]))
        y = torch.cat([rotate(heads, cos, sin).flatten(1), y[:, rot_cols:]], 1)
    return y, h


def skinny_linear_fake(x, w, bias, gamma, eps, glu, residual, glu_out, cos=None, sin=None,
                 rot_cols=0):
    n = w.shape[0] // 2 if glu_out else w.shape[0]
    return (x.new_empty((x.shape[0], n)),
            x.new_empty(tuple(x.shape) if residual is not None else (0,)))


skinny_linear.register_fake(skinny_linear_fake)
