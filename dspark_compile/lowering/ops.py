"""The ``dspark::`` custom ops: schema, fake (meta) implementation and reference kernel.

Each op is a ``torch.library`` custom op so that it shows up as one node in a captured graph,
carries shapes through fake tensors, and mutates the KV pool in place (``mutates_args``):
slice assignment into a cache inside a compiled graph is functionalized into copies of the
whole cache, which is why KV writes are ops of their own.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import linear_dense, linear_ops, reference
from .launch import zeros_when_warming

__all__ = ["ragged_attention", "dense_cached_attention", "RAGGED_OPS", "DENSE_OPS"]


@torch.library.custom_op("dspark::ragged_attention", mutates_args=("k_cache", "v_cache"))
def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor,
                     slot_mapping: torch.Tensor, scale: float) -> torch.Tensor:
    """Packed causal paged attention. q ``[N, H, D]``, k/v ``[N, Hkv, D]`` -> ``[N, H, D]``."""
    return reference.ragged_attention(q, k, v, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_table, slot_mapping, scale)


@ragged_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale):
    return torch.empty_like(q)


@torch.library.custom_op("dspark::dense_cached_attention", mutates_args=("k_cache", "v_cache"))
def dense_cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Dense verify attention over the paged pool. q ``[bs, H, T, D]`` -> ``[bs, T, H, D]``."""
    return reference.dense_cached_attention(q, k, v, k_cache, v_cache, block_table,
                                            context_lens, scale)


@dense_cached_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, context_lens, scale):
    bs, num_heads, t, d = q.shape
    return q.new_empty(bs, t, num_heads, d)


RAGGED_OPS = (torch.ops.dspark.ragged_attention, *linear_ops.LINEAR_RAGGED_OPS)
"""Op packets of the ragged families (what the packed graph may contain)."""
DENSE_OPS = (torch.ops.dspark.dense_cached_attention, *linear_dense.DENSE_LINEAR_OPS)
"""Op packets of the dense families (what a capture emits and the passes must rewrite)."""


@torch.library.custom_op("dspark::ragged_attention_triton",
                         mutates_args=("k_cache", "v_cache"), device_types=("cuda",))
def ragged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor,
                            scale: float, max_query_len: int,
                            early_reads: bool = False) -> torch.Tensor:
    """``dspark::ragged_attention`` lowered to Triton (CUDA and ROCm devices).

    ``max_query_len`` sizes the query tile (the verify block); results are exact for any
    value, a longer request (a prefill) just spans more tiles. ``early_reads``: the launch
    before this one writes none of the metadata nor the pools' committed rows, so they may be
    read before the PDL wait (``select.early_attention_reads`` decides it from the graph).
    """
    from .triton_attention import ragged_attention_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(
        q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
        max_query_len=max_query_len, early_reads=early_reads))


@ragged_attention_triton.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      max_query_len, early_reads=False):
    return torch.empty_like(q)


@torch.library.custom_op("dspark::linear_group", mutates_args=())
def linear_group(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]``: matmuls by weights that read the same rows ``x [M, K]``
    (each ``w [N_i, K]``), one node; the reference is ``torch.mm`` per weight."""
    return [torch.mm(x, w.t()) for w in weights]


@linear_group.register_fake
def _(x, weights):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


@torch.library.custom_op("dspark::linear_group_triton", mutates_args=(), device_types=("cuda",))
def linear_group_triton(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``dspark::linear_group`` lowered to Triton (one launch per group at small M)."""
    from .triton_linear import linear_group_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(x, weights))


@linear_group_triton.register_fake
def _(x, weights):
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t * cos[:, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[:, None]


@torch.library.custom_op("dspark::rotary_apply", mutates_args=())
def rotary_apply(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> list[torch.Tensor]:
    """HF's ``q * cos + rotate_half(q) * sin`` for a layer's q ``x [N, Hx, D]`` and k ``y [N, Hy,
    D]`` with ``cos``/``sin [N, D]``, one node; the reference is that math in the inputs' dtype
    (the ops the model's own graph ran)."""
    return [_rotate(x, cos, sin), _rotate(y, cos, sin)]


@rotary_apply.register_fake
def _(x, y, cos, sin):
    return [torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(y.shape, dtype=y.dtype, device=y.device)]


@torch.library.custom_op("dspark::rotary_apply_triton", mutates_args=(), device_types=("cuda",))
def rotary_apply_triton(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> list[torch.Tensor]:
    """``dspark::rotary_apply`` lowered to Triton (q and k in one launch)."""
    from .triton_rotary import rotary_apply_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(x, y, cos, sin))


@rotary_apply_triton.register_fake
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
    when a residual is given, else an empty tensor (``lowering/fuse_linear.py``). With
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
        y = torch.cat([_rotate(heads, cos, sin).flatten(1), y[:, rot_cols:]], 1)
    return y, h


def _skinny_fake(x, w, bias, gamma, eps, glu, residual, glu_out, cos=None, sin=None,
                 rot_cols=0):
    n = w.shape[0] // 2 if glu_out else w.shape[0]
    return (x.new_empty((x.shape[0], n)),
            x.new_empty(tuple(x.shape) if residual is not None else (0,)))


skinny_linear.register_fake(_skinny_fake)


@torch.library.custom_op("dspark::skinny_linear_triton", mutates_args=(),
                         device_types=("cuda",))
def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                         gamma: Optional[torch.Tensor], eps: float, glu: bool,
                         residual: Optional[torch.Tensor],
                         glu_out: bool, cos: Optional[torch.Tensor] = None,
                         sin: Optional[torch.Tensor] = None,
                         rot_cols: int = 0,
                         weight_settled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``dspark::skinny_linear`` lowered to Triton (one launch at a verify step's few rows).
    ``weight_settled``: no launch of the graph writes ``w`` (``select.settled_weight``), so its
    first tile may be read before the PDL wait."""
    from .triton_skinny import skinny_linear_triton as kernel  # needs a GPU driver

    return zeros_when_warming(kernel(x, w, bias, gamma, eps, glu, residual, glu_out, cos=cos,
                                     sin=sin, rot_cols=rot_cols, weight_settled=weight_settled))


def _skinny_triton_fake(x, w, bias, gamma, eps, glu, residual, glu_out, cos=None, sin=None,
                        rot_cols=0, weight_settled=False):
    return _skinny_fake(x, w, bias, gamma, eps, glu, residual, glu_out, cos, sin, rot_cols)


skinny_linear_triton.register_fake(_skinny_triton_fake)


LOWERED = {"triton": {torch.ops.dspark.ragged_attention: torch.ops.dspark.ragged_attention_triton,
                      torch.ops.dspark.linear_group: torch.ops.dspark.linear_group_triton,
                      torch.ops.dspark.rotary_apply: torch.ops.dspark.rotary_apply_triton,
                      torch.ops.dspark.skinny_linear: torch.ops.dspark.skinny_linear_triton,
                      **linear_ops.LINEAR_LOWERED["triton"]}}
"""Per lowering: reference op packet -> the op that implements it there."""
