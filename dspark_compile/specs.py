"""Shapes of a model's stateful layers: what the frontend reads off a model and the state
allocates pools for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionSpec", "CompressSpec", "IndexSpec", "LinearSpec", "PositionLimit",
           "RingSpec", "compress_pools", "index_pools"]


@dataclass(frozen=True)
class CompressSpec:
    """A compressed-attention layer's compressor (DeepSeek-V4's HCA and CSA): per request,
    raw per-token ``kv`` / ``gate`` rows of ``width`` channels and one entry of ``head_dim``
    channels per closed window of ``rate`` tokens (``ops/compressed_reference.py``)."""

    rate: int
    """Tokens per window."""
    head_dim: int
    """Channels of an entry (the layer's head dim: an entry is key and value)."""
    overlap: bool = False
    """CSA: entry ``w`` also pools window ``w - 1``'s first half (raw rows are 2 * head_dim
    wide); HCA: False."""
    index_topk: int = 0
    """CSA: entries the indexer keeps per query (0: no indexer, every closed entry is seen)."""
    index_heads: int = 0
    """CSA: indexer query heads."""
    index_head_dim: int = 0
    """CSA: channels of an indexer entry (the indexer compresses with overlap too)."""

    @property
    def width(self) -> int:
        """Channels of a raw ``kv`` / ``gate`` row."""
        return 2 * self.head_dim if self.overlap else self.head_dim

    @property
    def pool_widths(self) -> tuple[int, ...]:
        """Channels of each of the layer's pools, in order: raw kv, raw gate, entries (and the
        indexer's three with an indexer)."""
        own = (self.width, self.width, self.head_dim)
        return own + ((2 * self.index_head_dim,) * 2 + (self.index_head_dim,)
                      if self.index_topk else ())


@dataclass(frozen=True)
class IndexSpec:
    """A sparse-attention layer's own lightning indexer: one key of ``head_dim`` channels per
    token, ``topk`` keys kept per query (DeepSeek Sparse Attention), or ``topk`` blocks of
    ``block`` keys per query and indexer head (MiniMax-M3's block-sparse layers;
    ``ops/sparse_reference.py``)."""

    topk: int
    """Keys (blocks) the indexer keeps per query."""
    heads: int
    """Indexer query heads."""
    head_dim: int
    """Channels of an indexer query head and key."""
    block: int = 0
    """Keys a pick stands for (0: one key, DSA's picks shared by every head); else the picks are
    blocks, one row per indexer head."""
    local: int = 0
    """Blocks ending at a query's own that are always kept (block picks only)."""


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
    compress: CompressSpec | None = None
    """The layer's compressor (DeepSeek-V4 HCA / CSA layers); None: plain attention."""
    shared_kv: bool = False
    """The layer passes one tensor as both its keys and its values (DeepSeek-V4's K=V head):
    its K and V pools are one tensor, stored once."""
    chunk: int = 0
    """Chunked attention (Llama 4): a query at position p sees keys ``p - p % chunk <= k <= p``,
    its own chunk; 0: none. At most one of ``window`` and ``chunk`` is set."""
    sparse: bool = False
    """Each query attends only to the keys an indexer picked (DeepSeek Sparse Attention): the
    layer's own (``index``) or an earlier layer's, whose picks the model hands on."""
    index: IndexSpec | None = None
    """The layer's own indexer (its key pool); None: none (a plain layer, or a sparse layer that
    reuses an earlier layer's picks)."""
    relative: int = 0
    """Relative logits (Inkling): each query adds its own logit for a key's distance when the
    distance is below ``relative``; 0: none."""
    alibi: bool = False
    """ALiBi: each head adds its slope times ``kpos - qpos`` (Bloom)."""
    kv_from: int | None = None
    """The layer attends over an earlier layer's keys and values, handed on as the same tensors
    (Gemma 3n's and Gemma 4's KV-shared layers): its K/V pools are that layer's (this index in
    the specs), stored once; its step writes the same rows there again. None: its own pools."""

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
    fields are 0 (no recurrent state); ``"scan"``: ``dspark::ssd`` alone (MiniMax's lightning
    attention), whose conv fields are 0 (no conv window)."""
    name: str = ""
    """Where the layer is in the model (for messages)."""
    conv_dtype: torch.dtype | None = None
    """The conv's input dtype where it is not the model's (Inkling's short convolutions run in
    float32 in a 16-bit model): its state's dtype; None: the model's."""


@dataclass(frozen=True)
class RingSpec:
    """Row shape and dtype of one replay ring (the verifier reads them off the packed graph)."""

    name: str
    """Graph input name, e.g. ``conv_ring_0`` or ``gdn_ring_k_1``."""
    row_shape: tuple[int, ...]
    """Shape of one ring row (the ring is ``[max_step_tokens, *row_shape]``)."""
    dtype: torch.dtype
    """Element type."""


def compress_pools(specs) -> list[tuple[int, int]]:
    """``(attention layer, channels)`` of every compressor pool of ``specs``
    (``AttentionSpec`` list), in pool order: ``compress_pool_<j>`` is entry ``j``."""
    return [(i, w) for i, s in enumerate(specs or ()) if s.compress is not None
            for w in s.compress.pool_widths]


def index_pools(specs) -> list[tuple[int, int]]:
    """``(attention layer, channels)`` of every indexer key pool of ``specs``, in pool order:
    ``index_pool_<j>`` is entry ``j``."""
    return [(i, s.index.head_dim) for i, s in enumerate(specs or ()) if s.index is not None]


@dataclass(frozen=True)
class PositionLimit:
    """The first position a table cannot serve: ``positions`` (so a state of that many tokens
    fits), the table's graph name and its rows. With ``cache``: the positions the cache
    ``generate`` builds keeps of the attention layer ``table`` (``rows``), whose forward reads
    further back (``own_forward.cache_window_limit``)."""

    positions: int
    table: str
    rows: int
    cache: bool = False
    rotary: bool = False
    """A dynamic or longrope rotary (``table``: the module and its type) that keeps its
    frequencies below ``positions`` only (``frontend/rotary.py``)."""

    def reason(self) -> str:
        """What serves only ``positions`` tokens, for messages."""
        if self.rotary:
            return (f"the {self.positions} positions below which the rotary {self.table} "
                    "keeps its frequencies (past them transformers changes them from the "
                    "batch's longest position, so one request's logits would depend on the "
                    "others verified with it)")
        if self.cache:
            return (f"the {self.rows} positions that the cache generate builds for the model "
                    f"keeps of layer {self.table} (a sliding-window layer of its config, whose "
                    "forward reads every earlier position: past them its cached decoding is "
                    "not its forward, so no verify can match both)")
        return (f"the {self.positions} positions the model's position table {self.table} "
                f"({self.rows} rows) serves")
