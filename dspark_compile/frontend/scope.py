"""The capture scope: what a cached-attention layer sees while its model is being captured.

During capture the frontend opens a scope holding the (fake) paged KV pools and the dense
verify metadata; every cached-attention call in the model (HF's attention interface or
``dspark_compile.nn.CachedAttention``) reads it and emits one ``dspark::dense_cached_attention``
node. The scope is a ``ContextVar`` set and reset around the capture, never a module global
that outlives it.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from .. import ops  # noqa: F401  (registers the dspark:: ops)
from ..specs import AttentionSpec

__all__ = ["CaptureScope", "HF_ATTENTION_NAME", "active_scope", "open_scope", "outside_trace"]

HF_ATTENTION_NAME = "dspark"
"""Name of the capture's function in transformers' attention interface (``adapters.py``
registers it for the duration of a capture)."""


@dataclass
class CaptureScope:
    """Pools and metadata of one dense verify capture."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per attention layer, in pool order: K and V pools ``[pages, page_size, Hkv, D]``."""
    block_table: torch.Tensor
    """int32 ``[bs, pages_per_request]``: page ids of each dense request."""
    context_lens: torch.Tensor
    """int32 ``[bs]``: committed tokens of each dense request."""
    pool_index: dict[object, int] = field(default_factory=dict)
    """Layer key (HF ``layer_idx`` or module id) -> pool index."""
    slots: torch.Tensor | None = None
    """int32 ``[bs]``: state-pool row of each dense request (hybrid models only)."""
    conv_states: list[torch.Tensor] = field(default_factory=list)
    """Per linear layer (GDN, Mamba-2 or short conv): conv pool ``[S, dim, W-1]``."""
    recurrent_states: list[torch.Tensor] = field(default_factory=list)
    """Per linear layer: recurrent pool ``[S, Hv, K, V]`` float32 (Mamba-2: ``[S, H, N, P]``;
    a short-conv layer's is empty)."""
    vision_embeds: torch.Tensor | None = None
    """``[bs, T, hidden]``: vision-tower rows merged into the input embeddings at image/video
    tokens (mRoPE models only)."""
    deepstack_embeds: torch.Tensor | None = None
    """``[layers, bs, T, hidden]``: DeepStack rows added to the first text decoder layers'
    outputs (Qwen3-VL with DeepStack only)."""
    linear_calls: list[tuple[int, str]] = field(default_factory=list)
    """Hybrid-layer calls made so far in this forward: ``(linear layer, "conv" | "gdn" |
    "ssd")`` (``frontend/hybrid.py`` attributes each call to its layer and checks them)."""

    site_names: dict[int, str] = field(default_factory=dict)
    """``id(module)`` -> the module's qualified name in the model (for messages)."""
    discovered: list[AttentionSpec] | None = None
    """Set while the frontend discovers a model's attention layers: ``attend`` records each
    call's spec here and returns zeros instead of emitting an op (there are no pools yet)."""
    discovered_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list,
                                                                  repr=False)
    """While discovering: each call's keys and values, so that a later call handed the same
    tensors is seen reading that call's pools (``AttentionSpec.kv_from``)."""
    attention_calls: int = 0
    """Attention calls seen so far in this forward; call ``k`` owns pool ``k`` when the layer
    key is the call order (Hugging Face models)."""
    compress_pools: list[torch.Tensor] = field(default_factory=list)
    """Compressed-attention layers (DeepSeek-V4): every compressor pool, in
    ``specs.compress_pools`` order."""
    compress_index: dict[int, int] = field(default_factory=dict)
    """KV pool index of a compressed layer -> the index of its first compressor pool."""
    pending_compressed: tuple | None = None
    """``(compressor module, what its layer's next attention call adds)``: set by a replaced
    compressor forward (``frontend/compressed.py``), taken by that call. While discovering,
    what it adds is a ``CompressSpec``; while capturing ``(entry pool, fresh rows, rate,
    picks or None)``."""
    index_pools: list[torch.Tensor] = field(default_factory=list)
    """Sparse-attention layers with their own indexer (DSA): every indexer key pool, in
    ``specs.index_pools`` order."""
    index_index: dict[int, int] = field(default_factory=dict)
    """KV pool index of a layer with its own indexer -> the index of its key pool."""
    pending_index: tuple | None = None
    """``(indexer module, IndexSpec, picks)``: set by a replaced indexer forward
    (``frontend/sparse.py``), taken by its layer's attention call."""
    picks_made: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """``(picks, positions a pick stands for)`` of every indexer that ran in this forward: the
    only ``indices=`` / ``block_indices=`` an attention call accepts (a model hands one layer's
    picks on to later layers)."""
    positions: torch.Tensor | None = None
    """``[bs, T]``: the positions the adapter's forward was called with (Hugging Face models),
    for layers that use them outside rotary (Llama 4's query temperature tuning)."""
    _site: str = ""

    def expect_compressed(self, compressor, what) -> None:
        """A compressor ran: its layer's next attention call takes ``what``."""
        if self.pending_compressed is not None:
            raise NotImplementedError(
                f"{self.site_names.get(id(compressor), '?')}: a compressor ran while the "
                "previous compressor's attention call had not come yet; each compressor must "
                "be followed by its own layer's attention call")
        self.pending_compressed = (compressor, what)

    def take_compressed(self, module):
        """What the attention call of ``module`` adds (None: a plain layer). A pending
        compressor must be ``module.compressor``."""
        pending, self.pending_compressed = self.pending_compressed, None
        if pending is None:
            return None
        if getattr(module, "compressor", None) is not pending[0]:
            raise NotImplementedError(
                f"{self._site}: the attention call after compressor "
                f"{self.site_names.get(id(pending[0]), '?')!r} comes from a module whose "
                "compressor is another one; the compressed entries would reach the wrong layer")
        return pending[1]

    def expect_index(self, indexer, spec, picks) -> None:
        """An indexer ran: its layer's attention call takes its spec."""
        if self.pending_index is not None:
            raise NotImplementedError(
                f"{self.site_names.get(id(indexer), '?')}: an indexer ran while the previous "
                "indexer's attention call had not come yet; each indexer must be followed by "
                "its own layer's attention call")
        self.pending_index = (indexer, spec, picks)

    def take_index(self, module):
        """``(IndexSpec, picks)`` of the indexer ``module`` owns, which ran before this
        attention call (None: it owns none). An indexer that ran must be ``module.indexer``."""
        pending, self.pending_index = self.pending_index, None
        own = getattr(module, "indexer", None)
        if pending is None:
            if isinstance(own, torch.nn.Module):
                raise NotImplementedError(
                    f"{self._site}: the layer has an indexer that did not run before its "
                    "attention call; the sparse ops need the layer's own picks")
            return None
        if own is not pending[0]:
            raise NotImplementedError(
                f"{self._site}: the attention call after indexer "
                f"{self.site_names.get(id(pending[0]), '?')!r} comes from a module whose "
                "indexer is another one; the picks would reach the wrong layer")
        return pending[1:]

    def _first_pool(self, key: int, first: dict[int, int], what: str) -> int:
        """``first[pool index]`` of the layer whose attention call is ``key``: its first pool
        of kind ``what``, which it must have had when its layers were discovered."""
        index = self.pool_index.get(key)
        if index not in first:
            raise RuntimeError(
                f"attention call {key} ran {what} during the capture but had none when the "
                "model's layers were discovered; the forward must make the same calls every "
                "time")
        return first[index]

    def index_pool_of(self, key: int) -> torch.Tensor:
        """The indexer key pool of the layer whose attention call is ``key``."""
        return self.index_pools[self._first_pool(key, self.index_index, "an indexer")]

    def compress_pools_of(self, key: int) -> list[torch.Tensor]:
        """The compressor pools of the layer whose attention call is ``key``."""
        first = self._first_pool(key, self.compress_index, "a compressor")
        return self.compress_pools[first:first + 6]

    def attention_site(self, module) -> str:
        """Name the module making the next attention call (also kept for ``attend``)."""
        name = self.site_names.get(id(module), "?")
        self._site = name
        return f"{type(module).__name__} {name!r} (attention call {self.attention_calls})"

    def attend(self, key: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float, window: int = 0, softcap: float = 0.0,
               sinks: torch.Tensor | None = None, compressed=None,
               chunk: int = 0, picks: torch.Tensor | None = None,
               index=None, pick_block: int = 1,
               rel: torch.Tensor | None = None,
               alibi: torch.Tensor | None = None) -> torch.Tensor:
        """Dense cached attention of layer ``key`` (None: the next call in forward order):
        q ``[bs, H, T, Dk]``, k ``[bs, Hkv, T, Dk]``, v ``[bs, Hkv, T, Dv]`` ->
        ``[bs, T, H, Dv]``. ``compressed``: what the layer's compressor added
        (``take_compressed``), None for a plain layer. ``chunk``: chunked attention (0:
        none). ``picks [bs, T, P]``: the keys each query attends to (a sparse layer), with
        ``index`` the layer's own indexer's ``IndexSpec`` (None: the picks are an earlier
        layer's); block picks ``[bs, T, Hi, topk]`` stand for ``pick_block`` positions each.
        ``rel [bs, H, T, E]``: relative logits (a query's logit per key distance below E);
        ``alibi [H]``: ALiBi slopes."""
        if key is None:
            key = self.attention_calls
        self.attention_calls += 1
        if self.discovered is not None:
            if q.shape[1] % k.shape[1] or k.shape[-1] != q.shape[-1] or \
                    v.shape[1] != k.shape[1] or v.shape[2] != k.shape[2]:
                raise NotImplementedError(
                    f"attention call {key} ({self._site}): q {tuple(q.shape)}, k "
                    f"{tuple(k.shape)}, v {tuple(v.shape)}; dspark::ragged_attention needs "
                    "q [bs, H, T, D], k [bs, Hkv, T, D], v [bs, Hkv, T, Dv] with H a multiple "
                    "of Hkv")
            kv_from = self._kv_source(k, v, int(window), compressed)
            self.discovered_kv.append((k, v))
            self.discovered.append(AttentionSpec(
                int(k.shape[1]), int(k.shape[-1]),
                None if v.shape[-1] == k.shape[-1] else int(v.shape[-1]),
                int(window), float(softcap), sinks is not None, self._site, compressed,
                shared_kv=k is v, chunk=int(chunk), sparse=picks is not None, index=index,
                relative=0 if rel is None else int(rel.shape[-1]), alibi=alibi is not None,
                kv_from=kv_from))
            bs, heads, t, _ = q.shape
            return q.new_zeros(bs, t, heads, v.shape[-1])
        if key not in self.pool_index:
            raise RuntimeError(
                f"cached-attention layer {key!r} was called during capture but has no KV pool; "
                f"known layers: {sorted(map(str, self.pool_index))}"
            )
        k_cache, v_cache = self.kv_caches[self.pool_index[key]]
        if k_cache.shape[2:] != k.shape[1:2] + k.shape[3:] or \
                v_cache.shape[2:] != v.shape[1:2] + v.shape[3:]:
            raise RuntimeError(
                f"attention call {key} ({self._site}) has k {tuple(k.shape)}, v "
                f"{tuple(v.shape)} but its pools were sized {tuple(k_cache.shape)} / "
                f"{tuple(v_cache.shape)} when the model's layers were discovered; the forward "
                "must call the same layers with the same shapes every time")
        # the semantics arguments only where a layer has them: a plain layer's node is the
        # same as before they existed
        if picks is not None:
            extra = (int(pick_block),) if pick_block != 1 else ()
            return torch.ops.dspark.dense_sparse_attention(
                q, k, v, k_cache, v_cache, self.block_table, self.context_lens, float(scale),
                picks, sinks, *extra)
        if compressed is not None:
            entries, fresh, rate, picks = compressed
            return torch.ops.dspark.dense_compressed_attention(
                q, k, v, k_cache, v_cache, self.block_table, self.context_lens, float(scale),
                int(window), float(softcap), sinks, entries, fresh, rate, picks)
        more = rel is not None or alibi is not None
        extra = (int(window), float(softcap), sinks) if window or softcap or \
            sinks is not None or chunk or more else ()
        extra += (int(chunk),) if chunk or more else ()
        extra += (rel,) if more else ()
        extra += (alibi,) if alibi is not None else ()
        return torch.ops.dspark.dense_cached_attention(
            q, k, v, k_cache, v_cache, self.block_table, self.context_lens, float(scale),
            *extra)

    def _kv_source(self, k: torch.Tensor, v: torch.Tensor, window: int,
                   compressed) -> int | None:
        """The earlier call whose keys and values are ``k`` and ``v`` themselves, where its
        pools can serve this call as they are (the same window, so the same ring; no
        compressor on either): None otherwise, and the layer gets pools of its own (the same
        rows written twice)."""
        for j, (kj, vj) in enumerate(self.discovered_kv):
            if kj is k and vj is v:
                earlier = self.discovered[j]
                if earlier.window == window and earlier.compress is None and \
                        compressed is None:
                    return earlier.kv_from if earlier.kv_from is not None else j
                return None
        return None

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, activation: str) -> torch.Tensor:
        """Dense causal conv1d of linear layer ``layer``: x ``[bs, dim, T]`` -> same shape."""
        self.linear_calls.append((layer, "conv"))
        return torch.ops.dspark.dense_causal_conv1d(x, weight, bias, self.conv_states[layer],
                                                     self.slots, activation)

    def gated_delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         g: torch.Tensor, beta: torch.Tensor, scale: float,
                         use_qk_l2norm: bool) -> torch.Tensor:
        """Dense gated delta rule of linear layer ``layer``: ``[bs, T, Hv, V]``."""
        self.linear_calls.append((layer, "gdn"))
        return torch.ops.dspark.dense_gated_delta_rule(
            q, k, v, g, beta, self.recurrent_states[layer], self.slots, float(scale),
            bool(use_qk_l2norm))

    def ssd(self, layer: int, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
            B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
            dt_bias: torch.Tensor | None, dt_softplus: bool, dt_min: float,
            dt_max: float) -> torch.Tensor:
        """Dense Mamba-2 scan of linear layer ``layer``: ``[bs, T, H, P]`` float32."""
        self.linear_calls.append((layer, "ssd"))
        return torch.ops.dspark.dense_ssd(x, dt, A, B, C, D, dt_bias,
                                          self.recurrent_states[layer], self.slots,
                                          bool(dt_softplus), float(dt_min), float(dt_max))


_ACTIVE: contextvars.ContextVar[CaptureScope | None] = contextvars.ContextVar(
    "dspark_capture_scope", default=None
)


def active_scope() -> CaptureScope | None:
    """The scope of the capture in progress, or None outside a capture."""
    return _ACTIVE.get()


@contextlib.contextmanager
def open_scope(scope: CaptureScope):
    """Make ``scope`` the active one for the duration of a capture."""
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def outside_trace():
    """Real tensors inside a capture: neither the fake-tensor mode nor the tracer sees what runs
    in the block (reading a model's buffers as they are, probing a function on real values)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield
