"""Model adapters: how to find a model's cached-attention layers and run its dense forward.

Two kinds of model are understood:

* Hugging Face causal LMs. Attention is owned through transformers' ``AttentionInterface``
  (registered under the name ``"dspark"`` and set on the model only for the duration of a
  capture); the mask builder is told to build nothing, since causality over the paged cache is
  the cached-attention op's job.
* Plain PyTorch decoders whose attention is :class:`dspark_compile.nn.CachedAttention` and whose
  forward is ``model(input_ids [bs, T], positions [bs, T]) -> logits [bs, T, V]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from .plain import CachedAttention
from ..specs import AttentionSpec, LinearSpec
from .hybrid import hybrid_hooks, linear_layers, linear_spec
from .multimodal import MRopeSpec, mrope_spec, vision_hook
from .scope import active_scope

__all__ = ["ModelAdapter", "adapter_for"]

HF_ATTENTION_NAME = "dspark"


@dataclass
class ModelAdapter:
    """What the capture needs to know about one model."""

    model: nn.Module
    """The model whose dense verify forward is captured."""
    keys: list[object]
    """Cached-attention layer keys in pool order."""
    specs: list[AttentionSpec]
    """KV shape of each cached-attention layer, in pool order."""
    forward: Callable[..., torch.Tensor]
    """``(call, input_ids [bs, T], positions [bs, T]) -> logits [bs, T, V]``, where ``call``
    invokes the model (the capture passes a functional call over fake parameters)."""
    hooks: Callable[[], contextlib.AbstractContextManager]
    """Context manager that routes the model's attention to the capture scope."""
    kind: str
    """``"hf"`` or ``"plain"``: how the model was recognised (shown by ``explain``)."""
    linear_specs: list[LinearSpec] = field(default_factory=list)
    """State shape of each linear-attention (Gated DeltaNet) layer, in layer order."""
    mrope: MRopeSpec | None = None
    """Multimodal rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): positions are
    ``[3, bs, T]`` and ``vision_embeds [bs, T, hidden]`` is one more input; None otherwise."""


def adapter_for(model: nn.Module) -> ModelAdapter:
    """Recognise ``model`` or raise ``TypeError`` saying what a model must provide."""
    if _is_hf_model(model):
        return _hf_adapter(model)
    layers = [m for m in model.modules() if isinstance(m, CachedAttention)]
    if layers:
        return ModelAdapter(
            model=model,
            keys=[id(m) for m in layers],
            specs=[AttentionSpec(m.num_kv_heads, m.head_dim) for m in layers],
            forward=lambda call, ids, pos: call(ids, pos),
            hooks=contextlib.nullcontext,
            kind="plain",
        )
    raise TypeError(
        f"dspark_compile: {type(model).__name__} is neither a Hugging Face causal LM nor a "
        "module with dspark_compile.nn.CachedAttention layers; write its attention with "
        "CachedAttention so the KV cache can be owned"
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
    """transformers attention function: q ``[bs, H, T, D]`` -> (``[bs, T, H, D]``, None)."""
    scope = active_scope()
    if scope is None:
        raise RuntimeError(
            f"attention implementation {HF_ATTENTION_NAME!r} runs only inside a dspark_compile "
            "capture; set the model back to 'sdpa' or 'eager' to run it on its own"
        )
    _check_attention_arguments(module, dropout, kwargs)
    _check_mask(module, attention_mask)
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(
            f"{type(module).__name__} (layer {module.layer_idx}) is not causal; verify needs "
            "causal attention"
        )
    scale = module.scaling if scaling is None else scaling
    return scope.attend(module.layer_idx, query, key, value, scale), None


_PASS_THROUGH = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                           "output_router_logits", "output_hidden_states", "return_dict"})
"""Keywords HF hands every attention function that do not change what attention computes
(positions reach the graph as the layout's own input)."""


def _check_mask(module, attention_mask) -> None:
    """The mask a layer receives must be the capture's proof of plain causality (None)."""
    if attention_mask is None:
        return
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    what = f"builds {attention_mask.description}" if isinstance(attention_mask, _UnprovenMask) \
        else f"passes a mask of type {type(attention_mask).__name__} built outside the capture"
    raise NotImplementedError(
        f"{where}: the model {what}, not plain causal attention. dspark::ragged_attention "
        "computes causal attention only (sliding windows, chunked, bidirectional or blockwise "
        "masks are not implemented), so the model is refused rather than verified wrong")


def _check_attention_arguments(module, dropout, kwargs: dict) -> None:
    """Whitelist of what reaches the attention function: ``dspark::ragged_attention``
    implements causal attention with a scale, nothing else. A keyword outside
    ``_PASS_THROUGH`` is refused unless it is None (or ``is_causal=True``): sinks (``s_aux``),
    windows, softcaps and anything a later transformers adds would otherwise be dropped and the
    verify would be silently wrong."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if dropout:
        raise NotImplementedError(f"{where} passes dropout={dropout!r} to attention; verify "
                                  "needs dropout 0: call model.eval() before dspark_compile")
    for name, value in kwargs.items():
        if name in _PASS_THROUGH or value is None or (name == "is_causal" and value is True):
            continue
        what = f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
            repr(value)
        raise NotImplementedError(
            f"{where} passes {name}={what} to its attention function; "
            "dspark::ragged_attention implements causal attention with a scale only, so "
            f"{name!r} would be ignored and the verify would differ from the model. The model "
            "is refused rather than verified wrong")


_CAUSAL = "causal_mask_function"
"""The one leaf mask the ragged op computes."""
_SAME_AS_CHILD = {"and_masks.<locals>.and_mask": "mask_functions",
                  "remap_positions_for_packed_sequence.<locals>.inner_mask": "mask_function",
                  "add_offsets_to_mask_function.<locals>.inner_mask": "mask_function"}
"""Combinators that keep plain causal when what they combine is (an intersection; positions
remapped within one sequence; offsets), with the closure variable that holds the children."""
_ALWAYS_TRUE_IN_VERIFY = {"packed_sequence_mask_function.<locals>.inner_mask"}
"""Leaves that hold for every pair a verify computes: each request is one sequence."""


def _causal_only(*args, mask_function=None, attention_mask=None, **kwargs):
    """Mask builder for the dspark implementation. The ragged op computes causality itself, so
    no mask tensor is built; instead the model's own mask function (transformers'
    ``masking_utils`` closures) must be provably plain causal: every leaf it combines is
    ``causal_mask_function`` (or a same-sequence test that holds in a verify), combined only by
    intersection, position remapping or offsets. Anything else (sliding windows, chunks,
    bidirectional or blockwise overlays, ``or_masks``, padding, a mask function of the model's
    own) is refused by name: it would otherwise be dropped silently."""
    if attention_mask is not None:
        raise NotImplementedError("the model passed an attention_mask (padding) into the "
                                  "capture; verify takes none: padding is the layout's job")
    if mask_function is not None and not _is_causal(mask_function):
        return _UnprovenMask(_describe(mask_function))
    return None


@dataclass(frozen=True)
class _UnprovenMask:
    """What the mask builder returns for a mask that is not plain causal. A model may build
    masks it never uses (one per layer type), so the refusal comes from the attention call
    that receives it (``_check_mask``), naming the layer."""

    description: str


def _hf_mask_name(fn) -> str | None:
    """The qualified name of a transformers ``masking_utils`` mask function, else None."""
    if getattr(fn, "__module__", None) != "transformers.masking_utils":
        return None
    return getattr(fn, "__qualname__", None)


def _children(fn, var: str) -> tuple:
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    value = cells[var].cell_contents if var in cells else ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _is_causal(fn) -> bool:
    """Whether ``fn`` equals plain causal on every (query, key) pair of a verify."""
    name = _hf_mask_name(fn)
    if name == _CAUSAL:
        return True
    if name in _SAME_AS_CHILD:
        kids = _children(fn, _SAME_AS_CHILD[name])
        causal = [k for k in kids if _is_causal(k)]
        # an intersection is causal when one part is and the rest always hold in a verify
        return bool(causal) and all(_is_causal(k) or _hf_mask_name(k) in _ALWAYS_TRUE_IN_VERIFY
                                    for k in kids)
    return False


def _describe(fn) -> str:
    name = _hf_mask_name(fn)
    if name in _SAME_AS_CHILD:
        parts = ", ".join(_describe(k) for k in _children(fn, _SAME_AS_CHILD[name]))
        return f"{name.split('.')[0]}({parts})"
    return name.split(".")[0] if name else getattr(fn, "__qualname__", repr(fn))


@contextlib.contextmanager
def _batched_experts(model: nn.Module) -> Iterator[None]:
    """Mixture-of-experts models run their experts as ``batched_mm`` during a capture.

    transformers' default experts forward loops over the experts a batch happens to hit (data-
    dependent control flow, not traceable) and ``grouped_mm`` has no float32 CPU kernel; the
    ``batched_mm`` forward gathers each (token, expert) pair's weights and runs one ``bmm``, which
    the token-axis pass proves token-wise. The previous implementation is restored afterwards.
    """
    previous = getattr(model.config, "_experts_implementation", None)
    if previous is None or not hasattr(model, "set_experts_implementation") or \
            not model._can_set_experts_implementation():
        yield
        return
    model.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        model.set_experts_implementation(previous)


def _hf_attention_layers(model: nn.Module) -> Iterator[nn.Module]:
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "k_proj") and \
                hasattr(module, "head_dim"):
            yield module


def _hf_adapter(model: nn.Module) -> ModelAdapter:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = model.config
    layers = list(_hf_attention_layers(model))
    if not layers:
        raise TypeError(
            f"dspark_compile: found no attention layers (modules with layer_idx, k_proj, "
            f"head_dim) in {type(model).__name__}"
        )
    text_config = config.get_text_config()
    num_kv = getattr(text_config, "num_key_value_heads", None) or \
        text_config.num_attention_heads
    specs = [AttentionSpec(num_kv, m.head_dim) for m in layers]

    linear = linear_layers(model)
    mrope = mrope_spec(model)

    @contextlib.contextmanager
    def hooks():
        AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)
        AttentionMaskInterface.register(HF_ATTENTION_NAME, _causal_only)
        previous = config._attn_implementation
        model.set_attn_implementation(HF_ATTENTION_NAME)
        try:
            with hybrid_hooks(linear) if linear else contextlib.nullcontext(), \
                    vision_hook(model, mrope) if mrope else contextlib.nullcontext(), \
                    _batched_experts(model):
                yield
        finally:
            model.set_attn_implementation(previous)

    def forward(call, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return call(input_ids=ids, position_ids=pos, use_cache=False).logits

    return ModelAdapter(model, [m.layer_idx for m in layers], specs, forward, hooks, "hf",
                        [linear_spec(m) for m in linear], mrope)
