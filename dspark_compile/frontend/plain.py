"""Layers a plain PyTorch decoder calls so that dspark_compile can own its KV cache.

A model author writes attention with :class:`CachedAttention` (the one layer an engine's
attention module would be) and every other op as free-form torch. Outside a capture the layer
is plain causal self-attention over the tokens it is given, so the model still runs on its own
(that full-sequence forward is the oracle the packed verify is tested against).
"""

from __future__ import annotations

import torch
from torch import nn

from .scope import active_scope

__all__ = ["CachedAttention"]


class CachedAttention(nn.Module):
    """Causal attention over a KV cache owned by dspark_compile.

    ``forward(q, k, v)`` takes ``q [bs, T, H, D]`` and ``k, v [bs, T, Hkv, D]`` (token-major,
    after rotary) and returns ``[bs, T, H, D]``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"CachedAttention: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads} (grouped-query attention needs whole groups)"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else float(scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scope = active_scope()
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [bs, heads, T, D]
        if scope is not None:
            return scope.attend(id(self), q, k, v, self.scale)
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale
        )
        return out.transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}")
