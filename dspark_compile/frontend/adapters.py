"""Model adapters: how to find a model's cached-attention layers and run its dense forward.

Two kinds of model are understood:

* Hugging Face causal LMs. Attention is owned through transformers' ``AttentionInterface``
  (registered under the name ``"dspark"`` and set on the model only for the duration of a
  capture): every module that calls it is an attention layer, whatever its attribute names.
  The mask builder builds no tensor: it proves the model's mask function equal to causal
  attention with an optional left window, which the cached-attention op computes itself.
* Plain PyTorch decoders whose attention is :class:`dspark_compile.nn.CachedAttention` and whose
  forward is ``model(input_ids [bs, T], positions [bs, T]) -> logits [bs, T, V]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .plain import CachedAttention
from ..specs import AttentionSpec, LinearSpec, PositionLimit
from .compressed import compressor_hooks
from .sparse import indexer_hooks, sparse_attention_module
from .masks import built_proofs_pass, causal_only, check_mask, proof_object
from .inline import inline_hooks
from .counted_positions import counted_positions_hooks
from .bloom import AlibiSlopes, bloom_hooks
from .dbrx import dbrx_hooks
from .jetmoe import jetmoe_hooks
from .griffin import griffin_hooks
from .inkling2 import inkling2_hooks, row_sinks_module
from .relative import RelativeLogits, relative_hooks
from .zaya import zaya_hooks
from .longcat import longcat_hooks
from .aria import aria_hooks
from .rotary import check_rotaries, fixed_rotaries, phimoe_hooks
from .experts import experts_hooks
from .hybrid import RecurrentLayers, hybrid_hooks
from .llama4 import temperature_hooks, tuned_queries
from .multimodal import MRopeSpec, media_notice, mrope_spec, vision_hook
from .scope import HF_ATTENTION_NAME, active_scope

__all__ = ["ModelAdapter", "adapter_for"]


@dataclass
class ModelAdapter:
    """What the capture needs to know about one model."""

    model: nn.Module
    """The model whose dense verify forward is captured."""
    keys: list[object] | None
    """Cached-attention layer keys in pool order (None until the capture discovers them)."""
    specs: list[AttentionSpec] | None
    """KV shape and semantics of each cached-attention layer, in pool order (None until the
    capture discovers them from the forward)."""
    forward: Callable[..., torch.Tensor]
    """``(call, input_ids [bs, T], positions [bs, T]) -> logits [bs, T, V]``, where ``call``
    invokes the model (the capture passes a functional call over fake parameters)."""
    hooks: Callable[[], contextlib.AbstractContextManager]
    """Context manager that routes the model's attention to the capture scope."""
    kind: str
    """``"hf"`` or ``"plain"``: how the model was recognised (shown by ``explain``)."""
    linear_specs: list[LinearSpec] = field(default_factory=list)
    """State shape of each recurrent layer (Gated DeltaNet, Mamba-2, short conv), in layer
    order; a Hugging Face model's is filled by the discovery forward (``recurrent.py``)."""
    mrope: MRopeSpec | None = None
    """Multimodal rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): positions are
    ``[3, bs, T]`` and ``vision_embeds [bs, T, hidden]`` is one more input; None otherwise."""
    site_names: dict[int, str] = field(default_factory=dict)
    """``id(module)`` -> qualified module name, for naming layers in messages."""
    rotary_limit: PositionLimit | None = None
    """The context below which a dynamic or longrope rotary keeps its frequencies
    (``rotary.py``), None: no such rotary."""


def adapter_for(model: nn.Module) -> ModelAdapter:
    """Recognise ``model`` or raise ``TypeError`` saying what a model must provide."""
    if _is_hf_model(model):
        return _hf_adapter(model)
    layers = [m for m in model.modules() if isinstance(m, CachedAttention)]
    if layers:
        return ModelAdapter(
            model=model,
            keys=[id(m) for m in layers],
            specs=[AttentionSpec(m.num_kv_heads, m.head_dim, name=name) for name, m in
                   model.named_modules() if isinstance(m, CachedAttention)],
            forward=lambda call, ids, pos: call(ids, pos),
            hooks=contextlib.nullcontext,
            kind="plain",
        )
    inner = getattr(model, "get_base_model", None)  # a PEFT wrapper: its model is the one
    hint = (f" ({type(model).__name__} wraps {type(inner()).__name__}: pass "
            "model.get_base_model(), whose LoRA layers are watched)"
            if callable(inner) and isinstance(inner(), nn.Module) and inner() is not model
            else "")
    raise TypeError(
        f"dspark_compile: {type(model).__name__} is neither a Hugging Face causal LM nor a "
        "module with dspark_compile.nn.CachedAttention layers; write its attention with "
        f"CachedAttention so the KV cache can be owned{hint}"
    )


# ---------------------------------------------------------------------- Hugging Face
def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
    """transformers attention function: q ``[bs, H, T, Dk]`` -> (``[bs, T, H, Dv]``, None).

    Every module that calls it is a cached-attention layer (found from the forward, not from
    attribute names); what it computes is read off this call and checked against what
    ``dspark::ragged_attention`` implements."""
    scope = active_scope()
    if scope is None:
        raise RuntimeError(
            f"attention implementation {HF_ATTENTION_NAME!r} runs only inside a dspark_compile "
            "capture; set the model back to 'sdpa' or 'eager' to run it on its own"
        )
    where = scope.attention_site(module)
    query = tuned_queries(module, query, scope.positions, where)
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(
            f"{where} is not causal (is_causal=False); verify needs causal attention")
    window, chunk = check_mask(where, attention_mask)
    index = scope.take_index(module)
    picks, block_picks = kwargs.pop("indices", None), kwargs.pop("block_indices", None)
    pick_block = 1
    if picks is not None or block_picks is not None or index is not None:
        picks, pick_block = _check_sparse(where, module, picks, block_picks, index, scope)
    rel = _take_marked(kwargs, "position_bias", RelativeLogits)  # relative.py, inkling2.py
    alibi = _take_marked(kwargs, "alibi", AlibiSlopes)  # bloom.py
    row_sinks = kwargs.pop("sinks", None) if row_sinks_module(module) else None
    softcap, sinks = _check_attention_arguments(where, dropout, kwargs, window, query)
    if row_sinks is not None:  # [bs, H, T, 1]: the model's eager joins it as one more column
        bs, heads, t, _ = query.shape
        if sinks is not None or tuple(row_sinks.shape) != (bs, heads, t, 1):
            raise NotImplementedError(
                f"{where} passes sinks= of shape {tuple(row_sinks.shape)} (or beside s_aux=); "
                f"a row's own sinks are understood as [bs, H, T, 1] = {(bs, heads, t, 1)}")
        sinks = row_sinks.squeeze(-1)
    if alibi is not None and (picks is not None or softcap):
        raise NotImplementedError(
            f"{where} passes ALiBi slopes with an indexer's picks or a softcap; "
            "dspark::ragged_attention adds them to causal, windowed or chunked attention only")
    if rel is not None and (picks is not None or chunk or softcap):
        raise NotImplementedError(
            f"{where} passes relative logits with an indexer's picks, chunks or a softcap; "
            "dspark::ragged_attention adds them to causal or sliding-window attention only")
    if picks is not None and (window or chunk or softcap):
        raise NotImplementedError(
            f"{where} attends to an indexer's picks under a window, chunks or a softcap; "
            "dspark::sparse_attention implements causal picks with optional sinks only")
    if scaling is None:
        scaling = getattr(module, "scaling", None)
    if scaling is None:
        raise NotImplementedError(f"{where} passes no scaling and has no .scaling attribute; "
                                  "the softmax scale cannot be read off the model")
    compressed = scope.take_compressed(module)
    if compressed is not None and (key is not value or softcap):
        raise NotImplementedError(
            f"{where} has a compressor but its keys and values are not the same tensor (or it "
            "passes a softcap); the compressed entries are read as both key and value")
    if compressed is not None and chunk:
        raise NotImplementedError(f"{where} has a compressor and a chunked mask; the compressed "
                                  "attention implements sliding windows only")
    if picks is not None and compressed is not None:
        raise NotImplementedError(f"{where} has both a compressor and an indexer's picks")
    return scope.attend(None, query, key, value, float(scaling), window=window,
                        softcap=softcap, sinks=sinks, compressed=compressed, chunk=chunk,
                        picks=picks, index=None if index is None else index[0],
                        pick_block=pick_block, rel=rel, alibi=alibi), None


def _take_marked(kwargs: dict, name: str, marker: type):
    """The tensor of ``kwargs[name]`` when it is a ``marker`` (a dataclass of one tensor that
    only a replaced forward makes), popped; None otherwise, anything else left in ``kwargs`` to
    be refused by name."""
    value = kwargs.get(name)
    if not isinstance(value, marker):
        return None
    del kwargs[name]
    return getattr(value, fields(marker)[0].name)


def _check_sparse(where: str, module, picks, block_picks, index, scope):
    """``indices=`` (DeepSeek Sparse Attention) and ``block_indices=`` (MiniMax-M3) are taken
    only from a known sparse attention class and forward, and only as picks an indexer of this
    capture returned, of the kind the keyword names; a layer whose own indexer ran must pass
    that indexer's picks. Returns ``(picks, positions a pick stands for)``."""
    given = "block_indices=" if block_picks is not None else "indices="
    if not sparse_attention_module(module):
        cls = type(module)
        raise NotImplementedError(
            f"{where} passes {given} to its attention function, but {cls.__module__}."
            f"{cls.__name__} is not a known sparse attention layer (class and forward source); "
            "what its indices mean cannot be proven, so the model is refused rather than "
            "verified wrong")
    if picks is not None and block_picks is not None:
        raise NotImplementedError(f"{where} passes both indices= and block_indices=; a layer "
                                  "attends to one indexer's picks")
    if picks is None and block_picks is None:
        raise NotImplementedError(f"{where}: the layer's indexer ran but its attention call "
                                  "passes no indices= or block_indices=; the picks would be "
                                  "dropped")
    picks = picks if picks is not None else block_picks
    block = next((b for p, b in scope.picks_made if picks is p), None)
    if block is None:
        raise NotImplementedError(
            f"{where} passes {given} that no indexer of this forward returned (a "
            f"{type(picks).__name__}); only an indexer's picks, or an earlier layer's handed "
            "on, are understood")
    if (block > 1) != (block_picks is not None):
        raise NotImplementedError(
            f"{where} passes {given} with an indexer's picks of {block} position(s) each; "
            "token picks are understood as indices= and block picks as block_indices= only")
    if index is not None and picks is not index[1]:
        raise NotImplementedError(f"{where}: the layer's own indexer ran but its attention "
                                  "call passes another layer's picks")
    return picks, block


_PASS_THROUGH = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                           "output_router_logits", "output_hidden_states", "return_dict",
                           "logits_to_keep"})
"""Keywords HF hands every attention function that do not change what attention computes
(positions reach the graph as the layout's own input; ``logits_to_keep`` is the LM head's row
selection, which a multimodal wrapper's forward hands on down with its other keywords)."""


def _check_attention_arguments(where: str, dropout, kwargs: dict, window: int = 0,
                               query: torch.Tensor | None = None):
    """Whitelist of what reaches the attention function; returns ``(softcap, sinks)``.

    Implemented: ``sliding_window`` (must equal the window the layer's mask proves: the mask is
    what eager/sdpa compute), ``softcap`` (Gemma 2 logit softcapping), ``s_aux`` (GPT-OSS
    per-head sinks ``[H]``). A keyword outside those and ``_PASS_THROUGH`` is refused unless it
    is None (or ``is_causal=True``): anything a later transformers adds would otherwise be
    dropped and the verify would be silently wrong."""
    if dropout:
        raise NotImplementedError(f"{where} passes dropout={dropout!r} to attention; verify "
                                  "needs dropout 0: call model.eval() before dspark_compile")
    softcap, sinks = 0.0, None
    for name, value in kwargs.items():
        if name in _PASS_THROUGH or value is None or (name == "is_causal" and value is True):
            continue
        if name == "sliding_window" and isinstance(value, int) and value == window:
            continue
        if name == "sliding_window" and isinstance(value, int):
            raise NotImplementedError(
                f"{where} passes sliding_window={value} but its mask proves "
                f"{'plain causal attention' if not window else f'a window of {window}'}; the "
                "model's eager and sdpa paths follow the mask, its flash path the keyword, so "
                "the model is refused rather than verified one way or the other")
        if name == "softcap" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value >= 0 and value == value and value != float("inf"):
            softcap = float(value)
            continue
        if name == "s_aux" and isinstance(value, torch.Tensor) and query is not None and \
                value.dim() == 1 and value.shape[0] == query.shape[1] and \
                value.is_floating_point():
            sinks = value
            continue
        what = f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
            repr(value)
        raise NotImplementedError(
            f"{where} passes {name}={what} to its attention function; "
            "dspark::ragged_attention implements causal attention with a scale, a left window "
            "(sliding_window matching the mask), a logit softcap (softcap >= 0) and per-head "
            "sinks (s_aux [heads]) only, so this would be ignored and the verify would differ "
            "from the model. The model is refused rather than verified wrong")
    return softcap, sinks


@contextlib.contextmanager
def _sdpa_route(config) -> Iterator[None]:
    """Models that call ``torch.nn.functional.scaled_dot_product_attention`` themselves
    instead of transformers' attention interface (Falcon): for the capture the model runs its
    "sdpa" path, the "sdpa" mask builder is the proving one (returning a proof object, never a
    tensor), and ``F.scaled_dot_product_attention`` is the cached-attention call. Everything is
    restored afterwards."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if getattr(config, "alibi", False):
        raise NotImplementedError(
            f"{config.model_type}: alibi=True adds an ALiBi position bias to the attention "
            "scores, which dspark::ragged_attention does not implement; the model is refused "
            "rather than verified wrong")
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    saved_mask, saved_sdpa = masks.get("sdpa"), F.scaled_dot_product_attention
    saved_impl = config._attn_implementation
    config._attn_implementation = "sdpa"
    masks["sdpa"] = proof_object
    F.scaled_dot_product_attention = _sdpa_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = saved_sdpa
        masks["sdpa"] = saved_mask
        config._attn_implementation = saved_impl


def _sdpa_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` while a model that calls it directly is captured:
    q ``[bs, H, T, Dk]`` -> ``[bs, H, T, Dv]`` through the capture scope."""
    scope = active_scope()
    where = f"scaled_dot_product_attention (attention call " \
        f"{scope.attention_calls if scope else '?'})"
    if scope is None:
        raise RuntimeError(f"{where} was routed by dspark_compile outside a capture")
    if attn_mask is None and is_causal is True:
        window = chunk = 0
    else:
        window, chunk = check_mask(where, attn_mask)
        if is_causal:
            raise NotImplementedError(f"{where} passes both a mask and is_causal=True")
    _check_attention_arguments(where, dropout_p, {})
    if query.shape[1] != key.shape[1] and not enable_gqa and key.shape[1] != 1:
        raise NotImplementedError(f"{where}: {query.shape[1]} query heads over "
                                  f"{key.shape[1]} key heads without enable_gqa (only one key head broadcasts)")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = scope.attend(None, query, key, value, float(scale), window=window, chunk=chunk)
    return out.transpose(1, 2)


def _hf_adapter(model: nn.Module) -> ModelAdapter:
    """Attention layers are found by the capture (``discover``): every call of the attention
    function in one forward is a layer, in call order, with the shapes of that call."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.config
    linear = RecurrentLayers(model)
    mrope = mrope_spec(model)
    if mrope is None:
        media_notice(model)
    names = {id(m): name for name, m in model.named_modules()}
    rotary_limit = check_rotaries(model, names)

    @contextlib.contextmanager
    def hooks():
        AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)
        AttentionMaskInterface.register(HF_ATTENTION_NAME, causal_only)
        previous = config._attn_implementation
        if model._can_set_attn_implementation():
            model.set_attn_implementation(HF_ATTENTION_NAME)
            route = contextlib.nullcontext()
        else:
            route = _sdpa_route(config)
        try:
            with contextlib.ExitStack() as stack:  # in this order; each restores on exit
                for hook in (route, built_proofs_pass(), fixed_rotaries(model),
                             hybrid_hooks(linear),
                             vision_hook(model, mrope) if mrope else contextlib.nullcontext(),
                             experts_hooks(model), *(family(model, names) for family in (
                                 dbrx_hooks, longcat_hooks, jetmoe_hooks, relative_hooks,
                                 inkling2_hooks, zaya_hooks, griffin_hooks, bloom_hooks,
                                 inline_hooks, counted_positions_hooks, compressor_hooks,
                                 indexer_hooks, temperature_hooks, phimoe_hooks, aria_hooks))):
                    stack.enter_context(hook)
                yield
        finally:
            if config._attn_implementation != previous:
                model.set_attn_implementation(previous)

    def forward(call, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        scope = active_scope()
        if scope is not None:
            scope.positions = pos  # per-token positions for layers that use them elsewhere
        return call(input_ids=ids, position_ids=pos, use_cache=False).logits

    return ModelAdapter(model, None, None, forward, hooks, "hf",
                        linear.specs, mrope, names, rotary_limit)
