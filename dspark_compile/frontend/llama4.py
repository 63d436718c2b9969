"""Llama 4's attention temperature tuning, captured per token.

``Llama4TextAttention`` scales the queries of its NoPE layers (``attn_temperature_tuning`` and
not ``use_rope``) by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at position ``p``,
making the positions as ``arange(T) + cache length``: one length for the whole batch, which a
ragged verify (every request at its own context) does not have, so the capture refuses that
``arange``. While a model is captured, :func:`temperature_hooks` turns the module's own
tuning off and the attention hook applies the same scaling to the queries it receives, with
each token's own position (the layout's ``positions``, which equal HF's ``arange(T) + cache
length`` for an unpadded request): ``(q * scales).to(q.dtype)``, as the module computes it,
before the transpose the hook sees past (an elementwise product commutes with it).

Only the exact class, with a forward whose source is one this was derived from, is taken; a
changed forward is refused rather than guessed at.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .replaced import known_forward

__all__ = ["KNOWN_SOURCES", "temperature_hooks", "tuned_queries"]

KNOWN_SOURCES = frozenset({"9183617f403133a7", "35a391036858580b"})
"""sha256 prefixes of ``Llama4TextAttention.forward`` in transformers 5.24 and 5.17 (which
differ only in naming the cache argument)."""

_TUNED: dict[int, tuple[float, float]] = {}
"""``id(module)`` -> ``(floor_scale, attn_scale)`` of the layers tuned by the hook, while a
capture runs."""


@contextlib.contextmanager
def temperature_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """For the capture: every tuned Llama 4 NoPE attention layer of ``model`` hands its query
    scaling to the attention hook (:func:`tuned_queries`); restored afterwards."""
    try:
        from transformers.models.llama4.modeling_llama4 import Llama4TextAttention
    except ImportError:  # a transformers without Llama 4: nothing to tune
        yield
        return
    tuned = [m for m in model.modules() if isinstance(m, Llama4TextAttention)
             and getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)]
    for m in tuned:
        if not known_forward(m, Llama4TextAttention, KNOWN_SOURCES):
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: its attention temperature "
                "tuning is captured from Llama4TextAttention's own forward (transformers 5.17 "
                "and 5.24) only, and this forward reads otherwise; the model is refused rather "
                "than verified wrong")
    saved = [(m, m.attn_temperature_tuning) for m in tuned]
    try:
        for m in tuned:
            _TUNED[id(m)] = (float(m.floor_scale), float(m.attn_scale))
            m.attn_temperature_tuning = False
        yield
    finally:
        for m, flag in saved:
            m.attn_temperature_tuning = flag
            _TUNED.pop(id(m), None)


def tuned_queries(module: nn.Module, query: torch.Tensor, positions: torch.Tensor | None,
                  where: str) -> torch.Tensor:
    """``query [bs, H, T, D]`` scaled as ``module``'s temperature tuning would, per token
    (``positions [bs, T]``); unchanged for any other module."""
    tuning = _TUNED.get(id(module))
    if tuning is None:
        return query
    if positions is None:
        raise NotImplementedError(f"{where} tunes its queries by position, but the capture "
                                  "has no per-token positions to give it")
    floor_scale, attn_scale = tuning
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (query * scales[:, None, :, None]).to(query.dtype)
