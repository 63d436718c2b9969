"""Rotary embeddings whose frequencies change with the sequence are refused before a capture.

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
are fixed when the module is built: :data:`FIXED_ROPE_TYPES`. Any other type, including one
this code does not know, is refused naming the module and the type.
"""

from __future__ import annotations

from torch import nn

__all__ = ["FIXED_ROPE_TYPES", "check_rotaries"]

FIXED_ROPE_TYPES = frozenset({"default", "linear", "yarn", "llama3", "proportional", "axial",
                              "ntk_alpha"})
"""Rope types whose frequencies transformers computes once, at init (none of them goes through
``dynamic_rope_update``'s recomputation): the shared ones, the vision towers' 2D ``"axial"``
(Qwen2-VL's family), and Hunyuan's ``"ntk_alpha"`` (its checkpoints say ``"dynamic"`` with a
fixed ``alpha``, which only stretches the base; the model renames the type so that nothing
recomputes it)."""


def _types(rope_type) -> list[tuple[str, object]]:
    """``(label, type)`` of a module's ``rope_type``: the string itself, or each per-layer-type
    entry of a dict."""
    if isinstance(rope_type, dict):
        return [(f"rope_type[{key!r}]", value) for key, value in rope_type.items()]
    return [("rope_type", rope_type)]


def check_rotaries(model: nn.Module, names: dict[int, str]) -> None:
    """Raise ``NotImplementedError`` naming the first rotary module of ``model`` whose rope
    type is not one of :data:`FIXED_ROPE_TYPES` (module docstring)."""
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None or not any(
                name.endswith("inv_freq") for name, _ in module.named_buffers(recurse=False)):
            continue
        for label, kind in _types(rope_type):
            if isinstance(kind, str) and kind in FIXED_ROPE_TYPES:
                continue
            why = ("recomputes its frequencies from the batch's longest position in every "
                   "forward (transformers' dynamic_rope_update), so a request's logits would "
                   "depend on the requests verified with it"
                   if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope")
                   else "is not a rope type whose frequencies are known to be fixed at init")
            raise NotImplementedError(
                f"{type(module).__name__} {names.get(id(module), '?')!r}: {label}={kind!r} "
                f"{why}; dspark_compile verifies rotary types {sorted(FIXED_ROPE_TYPES)} only, "
                "so the model is refused rather than verified wrong")
