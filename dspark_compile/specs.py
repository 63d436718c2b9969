"""Shapes of a model's stateful layers: what the frontend reads off a model and the state
allocates pools for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionSpec", "LinearSpec", "RingSpec"]


@dataclass(frozen=True)
class AttentionSpec:
    """Shape of one cached-attention layer's KV."""

    num_kv_heads: int
    """KV heads of the layer."""
    head_dim: int
    """Query/key channels per head."""
    v_head_dim: int | None = None
    """Value channels per head (None: ``head_dim``); DeepSeek's expanded MLA has 192 / 128."""
    window: int = 0
    """Left sliding window in Hugging Face's convention (a query at position p sees keys
    ``p - window < k <= p``); 0: plain causal."""
    softcap: float = 0.0
    """Attention-logit softcap (``softcap * tanh(s / softcap)``); 0: none."""
    sinks: bool = False
    """Whether the layer adds a learned per-head sink logit to the softmax denominator."""
    name: str = ""
    """Where the layer is in the model (shown by ``explain``)."""

    @property
    def value_dim(self) -> int:
        """Value channels per head."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


@dataclass(frozen=True)
class LinearSpec:
    """Shape of one linear-attention or state-space layer's state: a causal-conv window and
    (except for a conv-only layer) a float32 recurrent state ``[Hv, K, V]`` per slot."""

    conv_dim: int
    """Channels of the causal conv1d (GDN: q, k and v projections; Mamba-2: x, B and C)."""
    conv_width: int
    """Conv kernel width W; the conv state keeps the last W-1 inputs."""
    num_v_heads: int
    """Heads Hv of the recurrent state (Mamba-2: its heads H)."""
    head_k_dim: int
    """Key channels K per head (Mamba-2: the SSM state size N, B's and C's width)."""
    head_v_dim: int
    """Value channels V per head (Mamba-2: the head dim P, x's width)."""
    kind: str = "gdn"
    """``"gdn"``: Gated DeltaNet (conv, then ``dspark::gated_delta_rule``); ``"ssd"``: Mamba-2
    (conv, then ``dspark::ssd``); ``"conv"``: a short causal conv alone (LFM2), whose head
    fields are 0 (no recurrent state)."""
    name: str = ""
    """Where the layer is in the model (for messages)."""


@dataclass(frozen=True)
class RingSpec:
    """Row shape and dtype of one replay ring (the verifier reads them off the packed graph)."""

    name: str
    """Graph input name, e.g. ``conv_ring_0`` or ``gdn_ring_k_1``."""
    row_shape: tuple[int, ...]
    """Shape of one ring row (the ring is ``[max_step_tokens, *row_shape]``)."""
    dtype: torch.dtype
    """Element type."""
