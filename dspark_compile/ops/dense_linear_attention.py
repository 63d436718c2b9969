"""Dense forms of the hybrid-layer ops: what a capture emits for HF's conv and GDN calls.

A dense verify runs ``T`` tokens for each of ``bs`` requests; request ``b``'s state lives in
pool row ``slots[b]``. The ops only *read* the pools (the dense graph is the baseline the
passes start from, not a serving path); the ragged passes turn them into
``dspark::causal_conv1d`` / ``dspark::gated_delta_rule``, which also save the replay rings a
commit needs. The rings are not arguments here because their key-head count is only known once
the model has been traced (transformers 5.17 repeats the GDN key heads before the rule, 5.24
does not).

Schemas::

    dspark::dense_causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor conv_state,
        Tensor slots, str activation) -> Tensor
      x [bs, dim, T] (the layout HF's causal_conv1d_fn takes); conv_state [S, dim, W-1];
      slots [bs]. Returns [bs, dim, T] in x's dtype.

    dspark::dense_gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
        Tensor recurrent_state, Tensor slots, float scale, bool use_qk_l2norm) -> Tensor
      q, k [bs, T, Hk, K]; v [bs, T, Hv, V]; g [bs, T, Hv] or [bs, T, Hv, K] (one gate a key
      channel); beta [bs, T, Hv]; recurrent_state [S, Hv, K, V] float32. Returns
      [bs, T, Hv, V] in q's dtype.

The references are the ragged references on a uniform layout (every request ``T`` rows), with
scratch rings, so the dense and ragged forms can never disagree.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import linear_attention_reference as ref
from .ssd import SSD_DENSE_OPS

__all__ = ["dense_causal_conv1d", "dense_gated_delta_rule", "DENSE_LINEAR_OPS"]


def _uniform_qsl(bs: int, t: int, device) -> torch.Tensor:
    """``query_start_loc`` of ``bs`` requests of ``t`` rows each: ``[0, t, 2t, ...]``."""
    return (torch.arange(bs + 1, device=device, dtype=torch.int64) * t).to(torch.int32)


@torch.library.custom_op("dspark::dense_causal_conv1d", mutates_args=())
def dense_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        conv_state: torch.Tensor, slots: torch.Tensor,
                        activation: str) -> torch.Tensor:
    """Dense causal conv1d from each request's pool row. x ``[bs, dim, T]`` -> ``[bs, dim, T]``."""
    bs, dim, t = x.shape
    rows = x.transpose(1, 2).reshape(bs * t, dim)  # [bs*T, dim]
    ring = torch.empty(bs * t, dim, dtype=x.dtype, device=x.device)  # scratch: never replayed
    out = ref.causal_conv1d(rows, weight, bias, conv_state, _uniform_qsl(bs, t, x.device),
                            slots, ring, activation)
    return out.view(bs, t, dim).transpose(1, 2).contiguous()


@dense_causal_conv1d.register_fake
def _(x, weight, bias, conv_state, slots, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dspark::dense_gated_delta_rule", mutates_args=())
def dense_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, recurrent_state: torch.Tensor,
                           slots: torch.Tensor, scale: float,
                           use_qk_l2norm: bool) -> torch.Tensor:
    """Dense gated delta rule from each request's pool row: ``[bs, T, Hv, V]``."""
    bs, t, hk, kd = k.shape
    hv, vd = v.shape[2:]
    n = bs * t
    f32 = dict(dtype=torch.float32, device=q.device)
    gates = g.shape[2:]  # (Hv,) or (Hv, K)
    rings = (torch.empty(n, hk, kd, **f32), torch.empty(n, hv, vd, **f32),  # scratch: never
             torch.empty(n, *gates, **f32), torch.empty(n, hv, **f32))       # replayed
    out = ref.gated_delta_rule(q.reshape(n, hk, kd), k.reshape(n, hk, kd), v.reshape(n, hv, vd),
                               g.reshape(n, *gates), beta.reshape(n, hv), recurrent_state,
                               _uniform_qsl(bs, t, q.device), slots, *rings, scale,
                               use_qk_l2norm)
    return out.view(bs, t, hv, vd)


@dense_gated_delta_rule.register_fake
def _(q, k, v, g, beta, recurrent_state, slots, scale, use_qk_l2norm):
    return q.new_empty(v.shape)


DENSE_LINEAR_OPS = (torch.ops.dspark.dense_causal_conv1d, torch.ops.dspark.dense_gated_delta_rule,
                    *SSD_DENSE_OPS)
"""Op packets of the dense hybrid-layer families, Mamba-2's included (to join
``ops.DENSE_OPS``)."""
