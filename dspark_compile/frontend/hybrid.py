"""Hugging Face hybrid models: route recurrent mixers' conv and scan calls through the capture.

Gated DeltaNet (Qwen3-Next, Qwen3.5; Kimi Linear's KDA), Mamba-2 (Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid,
Nemotron-H, Zamba2) and short-conv (LFM2) layers never pass through the attention interface:
they call *module-level* functions of their modeling module on every call. Assigning a
replacement to those module attributes is seen by the layer on transformers 5.17 and 5.24 alike
and traces as one node; it is global for the model class, so :func:`hybrid_hooks` sets the
replacements for the duration of a capture and restores the originals after it.

With ``use_cache=False`` (how the capture runs the model) a layer calls::

    causal_conv1d_fn(x [bs, dim, T], weight [dim, W], bias, activation="silu", **kwargs)
    torch_chunk_gated_delta_rule(q, k, v, g=, beta=, initial_state=None,
                                 output_final_state=False, use_qk_l2norm_in_kernel=True, **kwargs)
        -> (out [bs, T, Hv, V], None)
    chunk_kimi_delta_attention(...)      the same, g [bs, T, H, K] (Kimi Linear)
    mamba2_chunk_scan(...)                                   (frontend/mamba.py)

MiniMax's lightning attention runs its scan inside its own forward; ``frontend/minimax.py``
replaces that forward for the capture (a Mamba-2-form scan with no conv).

Which module made a call, and so which state pool it gets, is found from the forward itself
(``frontend/recurrent.py``): a module is a recurrent layer because of the calls it makes, never
because of its attribute names. Mamba-1 scans run as Mamba-2 scans (``frontend/mamba.py``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

import torch.nn.functional as F
from torch import nn

from . import mamba, minimax
from .recurrent import RecurrentLayers

__all__ = ["RecurrentLayers", "WINDOW_MODULES", "diagonal_scan", "hybrid_hooks",
           "one_hot_taps", "window"]

WINDOW_MODULES: set[str] = set()
"""``module.qualname`` of classes whose replaced forward (``frontend/inkling2.py``,
``frontend/zaya.py``, ``frontend/griffin.py``) reads past inputs through :func:`window` or
:func:`diagonal_scan`: a model holding one gets the recurrent-layer tracking even when its
modeling module defines none of the functions below."""

_active: list[RecurrentLayers] = []
"""The RecurrentLayers of the capture running now (hybrid_hooks sets it)."""


def _layers() -> RecurrentLayers:
    if not _active:
        raise RuntimeError("dspark_compile's capture-owned convs and scans run only inside a "
                           "capture")
    return _active[-1]


def window(x, taps, bias=None):
    """A causal depthwise conv over the tokens, ``x [bs, dim, T]``, ``taps [dim, W]`` (the
    oldest of the ``W`` positions first, as ``causal_conv1d_fn``'s weight), whose state of the
    last ``W - 1`` inputs the capture owns: one call per run of the calling module's forward,
    counted as that module's conv layer. One-hot taps make it a window of past inputs."""
    return _conv(_layers(), x, taps, bias)


def one_hot_taps(lags, width: int, dtype):
    """One-hot :func:`window` taps ``[len(lags), width]``: row ``i`` picks the input ``lags[i]``
    tokens back."""
    return F.one_hot(width - 1 - lags, width).to(dtype)


def diagonal_scan(x, dt, A, B, C):
    """A Mamba-1 selective scan (``mamba_selective_scan``'s arguments and result, no skip and no
    gate) whose state the capture owns, counted as the calling module's scan."""
    return mamba.selective_scan(_layers(), x, dt, A, B, C)

_GDN = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
        "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
"""Gated delta rules: Qwen3-Next / Qwen3.5's (one gate a head) and Kimi Linear's KDA (one gate
a key channel, ``g [bs, T, H, K]``), the same call signature."""


def _conv(layers: RecurrentLayers, x, weight, bias=None, activation=None, **kwargs):
    """Replacement of ``causal_conv1d_fn``: x ``[bs, dim, T]`` -> ``[bs, dim, T]``."""
    site = layers.site("causal_conv1d_fn")
    if site.discovering:
        layers.record(site, "conv", (int(weight.shape[0]), int(weight.shape[-1])), x.dtype)
        return x.new_zeros(x.shape)
    return site.scope.conv(site.layer, x, weight, bias, activation or "none")


def _conv_update(layers: RecurrentLayers, *args, **kwargs):
    """``causal_conv1d_update`` runs only with a cache; the capture runs with
    ``use_cache=False``."""
    site = layers.site("causal_conv1d_update")
    raise RuntimeError(
        f"{site.where} was called during a dspark_compile capture; the capture runs the model "
        "with use_cache=False, so a layer that still calls it keeps its own cache. Make the "
        "layer call causal_conv1d_fn when no cache is passed")


def _gated_delta_rule(layers: RecurrentLayers, query, key, value, g, beta, chunk_size=64,
                      initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """Replacement of ``torch_{chunk,recurrent}_gated_delta_rule``: ``(out, None)``."""
    site = layers.site("torch_chunk_gated_delta_rule")
    if initial_state is not None or output_final_state:
        raise RuntimeError(
            f"{site.where} was called with initial_state/output_final_state during a "
            "dspark_compile capture; the capture owns the recurrent state (use_cache=False)")
    if site.discovering:
        layers.record(site, "gdn", (int(value.shape[2]), int(key.shape[3]),
                                    int(value.shape[3])))
        return value.new_zeros(value.shape), None
    scale = kwargs.get("scale") or query.shape[-1] ** -0.5  # HF's default: 1/sqrt(K)
    out = site.scope.gated_delta_rule(site.layer, query, key, value, g, beta, scale,
                                      use_qk_l2norm_in_kernel)
    return out, None


_REPLACEMENTS = {
    "causal_conv1d_fn": _conv,
    "causal_conv1d_update": _conv_update,
    **{name: _gated_delta_rule for name in _GDN},
    "mamba2_chunk_scan": mamba.chunk_scan,
    "mamba2_selective_state_update": mamba.selective_state_update,
    "mamba_selective_scan": mamba.selective_scan,
    **{name: mamba.refuse_mamba1(name) for name in mamba.REFUSED},
}
"""Modeling-module function name -> its replacement (given the model's RecurrentLayers)."""


def _modeling_modules(model: nn.Module) -> list:
    """The modules (Python) that define ``model``'s module classes and a replaced function."""
    found = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None and any(hasattr(module, n) for n in _REPLACEMENTS):
            found[module.__name__] = module
    return list(found.values())


@contextlib.contextmanager
def hybrid_hooks(layers: RecurrentLayers) -> Iterator[None]:
    """Replace the recurrent functions of every modeling module of ``layers.model`` and track
    which module is running; restore everything after. A model whose modeling modules define
    none of the functions is left untouched."""
    modules = _modeling_modules(layers.model)
    lightning = minimax.has_lightning(layers.model)
    windows = any(f"{type(m).__module__}.{type(m).__qualname__}" in WINDOW_MODULES
                  for m in layers.model.modules())
    if not modules and not lightning and not windows:
        yield
        return
    saved = []
    try:
        for module in modules:
            for name, fn in _REPLACEMENTS.items():
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, functools.partial(fn, layers))
        _active.append(layers)
        with layers.tracking(), minimax.lightning_hooks(layers):
            yield
    finally:
        if _active and _active[-1] is layers:
            _active.pop()
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)
