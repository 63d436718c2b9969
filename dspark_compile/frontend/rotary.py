"""Rotary embeddings whose frequencies change with the sequence: refused, or bounded.

Transformers' rotary modules recompute their frequencies inside the forward for two rope
types (``dynamic_rope_update`` in ``modeling_rope_utils``): ``"dynamic"`` (NTK scaling that
grows with the longest position seen, and is reset below the original context) and
``"longrope"`` (the long factors once any position passes the original context, the short ones
otherwise). Either choice is made from ``max(position_ids)`` over the whole batch, so one
request's logits depend on the other requests verified with it, and on what the module saw in
earlier calls: no packed-ragged step can reproduce it per request. Capturing such a model
would fail deep inside the trace or, worse, fix the frequencies of the trace's positions.

So every module with an ``inv_freq`` buffer (``*_inv_freq`` per layer type) and a
``rope_type`` (a string, or a dict of them per layer type) must use a type whose frequencies
are fixed when the module is built (:data:`FIXED_ROPE_TYPES`), or ``"dynamic"``
(:data:`BOUNDED_ROPE_TYPES`): below its original context (``original_max_seq_len``) a dynamic
module never rescales (the batch's longest position never passes what it has cached), so up to
that context it is the fixed rotary it was built as. :func:`check_rotaries` takes it where it
has not grown yet (its frequencies are still the ones it was built with) and returns that
context as a :class:`~dspark_compile.specs.PositionLimit` (``new_state`` refuses a longer
``max_context``); :func:`fixed_rotaries` keeps the update from running while the model is
captured. Any other type (``"longrope"``, one this code does not know) is refused naming the
module and the type.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..specs import PositionLimit

__all__ = ["BOUNDED_ROPE_TYPES", "FIXED_ROPE_TYPES", "check_rotaries", "fixed_rotaries"]

FIXED_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional", "axial",
                              "ntk_alpha"})
"""Rope types whose frequencies transformers computes once, at init (none of them goes through
``dynamic_rope_update``'s recomputation): the shared ones, the vision towers' 2D ``"axial"``
(Qwen2-VL's family), and Hunyuan's ``"ntk_alpha"`` (its checkpoints say ``"dynamic"`` with a
fixed ``alpha``, which only stretches the base; the model renames the type so that nothing
recomputes it)."""


BOUNDED_ROPE_TYPES = frozenset({"dynamic"})
"""Rope types taken up to their original context only (module docstring)."""


def _types(rope_type) -> list[tuple[str, object, str | None]]:
    """``(label, type, layer type)`` of a module's ``rope_type``: the string itself, or each
    per-layer-type entry of a dict."""
    if isinstance(rope_type, dict):
        return [(f"rope_type[{key!r}]", value, key) for key, value in rope_type.items()]
    return [("rope_type", rope_type, None)]


def _rotaries(model: nn.Module):
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is not None and any(
                name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False)):
            yield module, rope_type


def _unscaled_context(module: nn.Module, label: str, layer_type: str | None,
                      where: str) -> int:
    """The original context of a dynamic rotary that has not rescaled yet (its cached length is
    at most the original and its frequencies are still the ones it was built with)."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    original = getattr(module, "original_max_seq_len", None)
    cached = getattr(module, f"{prefix}max_seq_len_cached",
                     getattr(module, "max_seq_len_cached", None))
    if isinstance(cached, torch.Tensor) and cached.numel() == 1:  # set from a forward's max
        cached = int(cached.item())
    freq = getattr(module, f"{prefix}inv_freq", None)
    built = getattr(module, f"{prefix}original_inv_freq", None)
    fails = (not isinstance(original, int) or isinstance(original, bool) or original < 1
             or not isinstance(cached, int) or not isinstance(freq, torch.Tensor)
             or not isinstance(built, torch.Tensor))
    if fails:
        raise NotImplementedError(
            f"{where}: {label}='dynamic' lacks the original context, cached length or "
            "frequencies transformers' dynamic_rope_update keeps, so where it rescales is "
            "unknown; the model is refused rather than verified wrong")
    if cached > original or freq.shape != built.shape or \
            not torch.equal(freq, built.to(freq.device)):
        raise NotImplementedError(
            f"{where}: {label}='dynamic' has rescaled its frequencies for {cached} positions "
            f"(a forward past its original {original}); a verify takes it below that context "
            "only, as built: rebuild or reload the model before dspark_compile")
    return original


def check_rotaries(model: nn.Module, names: dict[int, str]) -> PositionLimit | None:
    """Raise ``NotImplementedError`` naming the first rotary module of ``model`` whose rope
    type is neither one of :data:`FIXED_ROPE_TYPES` nor a :data:`BOUNDED_ROPE_TYPES` one that
    has not rescaled yet; return the fewest positions a bounded one serves (None: none)."""
    limit = None
    for module, rope_type in _rotaries(model):
        where = f"{type(module).__name__} {names.get(id(module), '?')!r}"
        for label, kind, layer_type in _types(rope_type):
            if isinstance(kind, str) and kind in FIXED_ROPE_TYPES:
                continue
            if isinstance(kind, str) and kind in BOUNDED_ROPE_TYPES:
                positions = _unscaled_context(module, label, layer_type, where)
                if limit is None or positions < limit.positions:
                    limit = PositionLimit(positions, f"{names.get(id(module), '?')} ({label}="
                                                     f"{kind!r})", positions, rotary=True)
                continue
            why = ("recomputes its frequencies from the batch's longest position in every "
                   "forward (transformers' dynamic_rope_update), so a request's logits would "
                   "depend on the requests verified with it"
                   if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")
                   else "is not a rope type whose frequencies are known to be fixed at init")
            raise NotImplementedError(
                f"{where}: {label}={kind!r} {why}; dspark_compile verifies rotary types "
                f"{sorted(FIXED_ROPE_TYPES)}, and {sorted(BOUNDED_ROPE_TYPES)} below their "
                "original context, only, so the model is refused rather than verified wrong")
    return limit


@contextlib.contextmanager
def fixed_rotaries(model: nn.Module) -> Iterator[None]:
    """While a model is captured, its :data:`BOUNDED_ROPE_TYPES` rotaries read as ``"default"``
    (so ``dynamic_rope_update`` leaves them as built, which :func:`check_rotaries` checked and
    bounded); restored after."""
    changed = []
    for module, rope_type in _rotaries(model):
        if isinstance(rope_type, dict):
            fixed = {k: "default" if v in BOUNDED_ROPE_TYPES else v for k, v in rope_type.items()}
        else:
            fixed = "default" if rope_type in BOUNDED_ROPE_TYPES else rope_type
        if fixed != rope_type:
            changed.append((module, rope_type, "rope_type" in module.__dict__))
            module.rope_type = fixed
    try:
        yield
    finally:
        for module, rope_type, own in changed:
            if own:
                module.rope_type = rope_type
            else:
                del module.rope_type
