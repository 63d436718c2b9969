"""Hugging Face hybrid models: route Gated DeltaNet conv and recurrence through the capture scope.

Qwen3-Next / Qwen3.5 linear-attention layers never pass through the attention interface: they
call *module-level* functions of their modeling module (``causal_conv1d_fn``,
``causal_conv1d_update``, ``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``)
on every call. Assigning a replacement to those module attributes is seen by the layer on
transformers 5.17 and 5.24 alike and traces as one node; it is global for the model class, so
:func:`hybrid_hooks` sets the replacements for the duration of a capture and restores the
originals after it.

With ``use_cache=False`` (how the capture runs the model) a layer calls::

    causal_conv1d_fn(x [bs, dim, T], weight [dim, W], bias, activation="silu", **kwargs)
    torch_chunk_gated_delta_rule(q, k, v, g=, beta=, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=True, **kwargs)
        -> (out [bs, T, Hv, V], None)

and each replacement emits the dense op over the layer's state pool (``CaptureScope.conv`` /
``CaptureScope.gated_delta_rule``). Call ``k`` of each kind belongs to linear layer ``k``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from torch import nn

from ..specs import LinearSpec
from .scope import active_scope

__all__ = ["linear_layers", "linear_spec", "hybrid_hooks"]

_REPLACED = ("causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
             "torch_recurrent_gated_delta_rule")


_RECURRENT = ("conv1d", "A_log")
"""What every state-space / linear-attention mixer of transformers has (a causal conv and a
decay), Gated DeltaNet and Mamba alike."""
_GATED_DELTA_NET = ("dt_bias", "layer_idx", "conv_dim", "conv_kernel_size", "num_v_heads",
                    "head_k_dim", "head_v_dim")
"""What tells a Gated DeltaNet layer apart, and what :func:`linear_spec` reads."""


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """Gated DeltaNet layers of ``model`` in layer order. Any other recurrent mixer (a module
    with a causal conv and ``A_log``: Mamba, Mamba-2, their hybrids) is refused by name: its
    state would not be owned."""
    found = []
    for name, m in model.named_modules():
        if not all(hasattr(m, a) for a in _RECURRENT):
            continue
        missing = [a for a in _GATED_DELTA_NET if not hasattr(m, a)]
        if missing:
            raise NotImplementedError(
                f"{type(m).__name__} {name!r} is a recurrent (state-space) mixer with conv1d "
                f"and A_log but not a Gated DeltaNet layer (it lacks {', '.join(missing)}); "
                "dspark_compile owns the state of Gated DeltaNet layers only, so the model is "
                "refused (Mamba and Mamba-2 mixers are not supported)")
        found.append(m)
    return sorted(found, key=lambda m: m.layer_idx)


def linear_spec(layer: nn.Module) -> LinearSpec:
    """State shape of one Gated DeltaNet layer."""
    return LinearSpec(conv_dim=layer.conv_dim, conv_width=layer.conv_kernel_size,
                      num_v_heads=layer.num_v_heads, head_k_dim=layer.head_k_dim,
                      head_v_dim=layer.head_v_dim)


def _scope(name: str):
    scope = active_scope()
    if scope is None:
        raise RuntimeError(
            f"{name} was replaced by dspark_compile and runs only inside a capture; the "
            "original is restored when the capture ends")
    return scope


def _conv(x, weight, bias=None, activation=None, **kwargs):
    """Replacement of ``causal_conv1d_fn``: x ``[bs, dim, T]`` -> ``[bs, dim, T]``."""
    return _scope("causal_conv1d_fn").conv(x, weight, bias, activation or "none")


def _conv_update(*args, **kwargs):
    """``causal_conv1d_update`` runs only with a cache; the capture runs with
    ``use_cache=False``."""
    raise RuntimeError(
        "causal_conv1d_update was called during a dspark_compile capture; the capture runs the "
        "model with use_cache=False, so a layer that still calls it keeps its own cache. Make "
        "the layer call causal_conv1d_fn when no cache is passed")


def _gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                      output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """Replacement of ``torch_{chunk,recurrent}_gated_delta_rule``: ``(out, None)``."""
    scope = _scope("torch_chunk_gated_delta_rule")
    if initial_state is not None or output_final_state:
        raise RuntimeError(
            "the gated delta rule was called with initial_state/output_final_state during a "
            "dspark_compile capture; the capture owns the recurrent state (use_cache=False)")
    scale = kwargs.get("scale") or query.shape[-1] ** -0.5  # HF's default: 1/sqrt(K)
    out = scope.gated_delta_rule(query, key, value, g, beta, scale, use_qk_l2norm_in_kernel)
    return out, None


@contextlib.contextmanager
def hybrid_hooks(layers: list[nn.Module]) -> Iterator[None]:
    """Replace the hybrid functions of every modeling module ``layers`` come from; restore after."""
    modules = {sys.modules[type(m).__module__] for m in layers}
    replacements = dict(zip(_REPLACED, (_conv, _conv_update, _gated_delta_rule,
                                        _gated_delta_rule)))
    saved = []
    try:
        for module in modules:
            for name, fn in replacements.items():
                if not hasattr(module, name):
                    raise TypeError(
                        f"{module.__name__} has no {name}; dspark_compile routes Gated DeltaNet "
                        f"layers through {_REPLACED} and cannot capture this modeling module")
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, fn)
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
