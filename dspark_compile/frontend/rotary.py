"""Rotary embeddings whose frequencies change with the sequence: refused, or bounded.

Transformers' rotary modules recompute their frequencies inside the forward for two rope
types (``dynamic_rope_update`` in ``modeling_rope_utils``): ``"dynamic"`` (NTK scaling that
grows with the longest position seen, and is reset below the original context) and
``"longrope"`` (the long factors once any position passes the original context, the short ones
otherwise). Either choice is made from ``max(position_ids)`` over the whole batch, so one
request's logits depend on the other requests verified with it, and on what the module saw in
earlier calls: no packed-ragged step can reproduce it per request past that context. Capturing
such a model as it stands would fail deep inside the trace or, worse, fix the frequencies of
the trace's positions.

Below its original context each of them is a fixed rotary, and that is where it is taken
(:data:`BOUNDED_ROPE_TYPES`); :func:`check_rotaries` returns the context as a
:class:`~dspark_compile.specs.PositionLimit` (``new_state`` refuses a longer ``max_context``)
and :func:`fixed_rotaries` keeps the update from running while the model is captured:

- ``"dynamic"`` (original context ``original_max_seq_len``): below it the batch's longest
  position never passes what the module has cached, so it never rescales and is the rotary it
  was built as. Taken only where it has not grown yet (its frequencies are still the ones it
  was built with); one that has is refused.
- ``"longrope"`` (original context: its rope parameters' ``original_max_position_embeddings``):
  below it every forward sets ``inv_freq`` to the short factors, ``original_inv_freq``, which
  the update never writes. The captured graph reads ``original_inv_freq``
  (:func:`short_frequencies`), so a long forward of the model's own (which writes the long
  factors into ``inv_freq``, in place in newer transformers) does not reach the verify. Taken
  only where the module's forward is ``dynamic_rope_update``'s (the rule above is that
  decorator's) and both buffers are there. PhiMoE's rotary (Phi-3.5-MoE) recomputes its
  frequencies from the config in its forward and scales cos and sin by ``short_mscale`` below
  the same context, ``long_mscale`` past it, a branch on the batch's longest position that no
  graph holds: :func:`phimoe_hooks` runs it as it is below that context while the model is
  captured (the forward's two known sources only, longrope only).

Every module with an ``inv_freq`` buffer (``*_inv_freq`` per layer type) and a ``rope_type`` (a
string, or a dict of them per layer type) must use a type whose frequencies are fixed when the
module is built (:data:`FIXED_ROPE_TYPES`) or a bounded one; any other type (one this code does
not know) is refused naming the module and the type.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..specs import PositionLimit
from .replaced import known_forward, modeling_instances, swapped_forward

__all__ = ["BOUNDED_ROPE_TYPES", "FIXED_ROPE_TYPES", "check_rotaries", "fixed_rotaries",
           "phimoe_hooks", "short_frequencies"]

FIXED_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional", "axial",
                              "ntk_alpha"})
"""Rope types whose frequencies transformers computes once, at init (none of them goes through
``dynamic_rope_update``'s recomputation): the shared ones, the vision towers' 2D ``"axial"``
(Qwen2-VL's family), and Hunyuan's ``"ntk_alpha"`` (its checkpoints say ``"dynamic"`` with a
fixed ``alpha``, which only stretches the base; the model renames the type so that nothing
recomputes it)."""


BOUNDED_ROPE_TYPES = frozenset({"dynamic", "longrope"})
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


def _hf_update_code():
    """The code object of ``dynamic_rope_update``'s wrapper (None: this transformers has no
    such decorator)."""
    try:
        from transformers.modeling_rope_utils import dynamic_rope_update
    except ImportError:
        return None
    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _short_context(module: nn.Module, label: str, layer_type: str | None,
                   where: str) -> int:
    """The original context of a longrope rotary, below which ``dynamic_rope_update`` gives it
    its short factors (``original_inv_freq``)."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    params = getattr(getattr(module, "config", None), "rope_parameters", None)
    if layer_type is not None and isinstance(params, dict):
        params = params.get(layer_type)
    original = params.get("original_max_position_embeddings") \
        if isinstance(params, dict) else None
    freq = getattr(module, f"{prefix}inv_freq", None)
    short = getattr(module, f"{prefix}original_inv_freq", None)
    code, forward, codes = _hf_update_code(), type(module).forward, []
    while forward is not None and len(codes) < 8:  # through torch.no_grad() and the like
        codes.append(getattr(forward, "__code__", None))
        forward = getattr(forward, "__wrapped__", None)
    if code is None or code not in codes:
        raise NotImplementedError(
            f"{where}: {label}='longrope' is taken where the module's forward is transformers' "
            "dynamic_rope_update (which gives it its short factors below its original "
            f"context), and {type(module).__name__}.forward is not: where its frequencies "
            "change is unknown, so the model is refused rather than verified wrong")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1 or \
            not isinstance(freq, torch.Tensor) or not isinstance(short, torch.Tensor) or \
            freq.shape != short.shape or f"{prefix}original_inv_freq" not in module._buffers:
        raise NotImplementedError(
            f"{where}: {label}='longrope' lacks the original context (its config's "
            "rope_parameters' original_max_position_embeddings) or the short frequencies "
            f"({prefix}original_inv_freq, a buffer shaped as {prefix}inv_freq) that transformers' "
            "dynamic_rope_update uses below it; the model is refused rather than verified wrong")
    return original


def short_frequencies(model: nn.Module, buffers: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{inv_freq name: short name}`` for each longrope rotary of ``model``: the names in
    ``buffers`` (``model.named_buffers()``) of the ``inv_freq`` buffer the forward reads and of
    the tensor it holds below the original context (``original_inv_freq``), which the capture
    binds in its place (module docstring). ``buffers`` gains the short tensor's name where it was
    missing: transformers 5.17 makes ``inv_freq`` the short tensor itself after a short forward,
    listed once under its first name, and swaps in a new one after a long forward."""
    out = {}
    names = {id(m): n for n, m in model.named_modules()}
    for module, rope_type in _rotaries(model):
        for _, kind, layer_type in _types(rope_type):
            if kind != "longrope":
                continue
            prefix = f"{layer_type}_" if layer_type is not None else ""
            path = names[id(module)]
            at = f"{path}." if path else ""
            freq, short = f"{at}{prefix}inv_freq", f"{at}{prefix}original_inv_freq"
            buffers.setdefault(short, getattr(module, f"{prefix}original_inv_freq"))
            out[freq] = short
    return out


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
                context = _short_context if kind == "longrope" else _unscaled_context
                positions = context(module, label, layer_type, where)
                if limit is None or positions < limit.positions:
                    limit = PositionLimit(positions, f"{names.get(id(module), '?')} ({label}="
                                                     f"{kind!r})", positions, rotary=True)
                continue
            why = ("recomputes its frequencies from the batch's longest position in every "
                   "forward (transformers' dynamic_rope_update), so a request's logits would "
                   "depend on the requests verified with it"
                   if isinstance(kind, str) and "dynamic" in kind
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


_PHIMOE_FORWARDS = frozenset({"bdf9273d05d27d62", "bd157b8ee7e047f6"})
"""``source_key`` of ``PhimoeRotaryEmbedding.forward`` in transformers 5.24 and 5.17."""


def _phimoe_short_forward(self, x, position_ids=None):
    """``PhimoeRotaryEmbedding.forward`` below its original context: the frequencies its
    ``rope_init_fn`` makes from the config without a length (longrope's short factors), cos and
    sin scaled by ``short_mscale``; each product is the one fp32 multiply both sources do."""
    inv_freq, _ = self.rope_init_fn(self.config)
    mscale = self.config.rope_parameters["short_mscale"]
    freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * mscale).to(x.dtype), (emb.sin() * mscale).to(x.dtype)


@contextlib.contextmanager
def phimoe_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """PhiMoE's longrope rotary below its original context while ``model`` is captured (module
    docstring; :func:`check_rotaries` bounds it there); one of another scaled type, or with
    another forward, is refused naming it. A model without one is left untouched."""
    classes, found = modeling_instances(
        model, "transformers.models.phimoe.modeling_phimoe", ("PhimoeRotaryEmbedding",))
    scaled = [m for m in found if m.config.rope_parameters.get("rope_type") != "default"]
    if not scaled:
        yield
        return
    cls, = classes
    for m in scaled:
        params = m.config.rope_parameters
        if params.get("rope_type") != "longrope" or not known_forward(m, cls, _PHIMOE_FORWARDS) \
                or not isinstance(params.get("short_mscale"), (int, float)):
            raise NotImplementedError(
                f"PhimoeRotaryEmbedding {names.get(id(m), '?')!r}: PhiMoE's scaled rotary is "
                "taken as longrope below its original context, from its forward's known sources "
                f"(transformers 5.24, 5.17) with a numeric short_mscale; this one has "
                f"rope_type={params.get('rope_type')!r} or another forward, so the model is "
                "refused rather than verified wrong")
    with swapped_forward(cls, _phimoe_short_forward):
        yield
