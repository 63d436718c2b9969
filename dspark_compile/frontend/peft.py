"""PEFT adapter layers: what their forward reads besides weights, watched on every call.

A PEFT LoRA layer (``peft.tuners.lora.layer.Linear``) adds ``lora_B(lora_A(x)) * scaling`` for
each of its active adapters to its base layer's output, unless its adapters are disabled or
merged into the base weight. Those choices are Python state of the layer: ``_disable_adapters``,
``_active_adapter``, ``merged_adapters`` and ``scaling``. A captured graph freezes them as they
were at the build, so after ``disable_adapter_layers()``, ``set_adapter``, ``merge_adapter()``
(which adds the delta to the base weight in place *and* stops the layer adding it: twice the
delta in a frozen graph) or ``set_scale`` the verify would no longer be the model's forward.

- :func:`adapter_layers` lists a model's PEFT tuner layers and refuses, by name, any it does not
  know how to watch: a tuner other than LoRA on a plain ``nn.Linear`` (IA3, LoHa, a LoRA
  embedding, convolution or quantized base), a LoRA ``Linear`` whose forward is not the one
  these fields were read from (PEFT 0.19 to 0.21, by its source's hash), a LoRA variant (DoRA
  and the like, whose forward keeps state of its own), a scaling that is not a number.
- :class:`AdapterWatch` keeps the four fields of each and says, on every call, which layer's
  changed (``session.weights`` raises ``StaleWeightsError`` naming it). Changing adapter
  weights in place (training steps, ``load_state_dict``) is served as for any weight.

A model holds no PEFT layer unless PEFT is imported, so nothing here imports it.
"""

from __future__ import annotations

import copy
import operator
import sys

from torch import nn

from .replaced import source_key

__all__ = ["AdapterWatch", "adapter_layers"]

_STATE = ("_disable_adapters", "_active_adapter", "merged_adapters", "scaling")
"""The layer fields a LoRA ``Linear.forward`` branches on or scales by (PEFT 0.19 to 0.21)."""

_LORA_FORWARDS = frozenset({"ec0a80f5c5ce05f5"})
"""``source_key`` of ``peft.tuners.lora.layer.Linear.forward`` in PEFT 0.19.1, 0.20.0 and
0.21.0-0.21.2 (the one forward :data:`_STATE` was read from)."""


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every PEFT tuner layer of ``model``; ``NotImplementedError`` naming
    the first one that is not a watchable LoRA layer (module docstring)."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    if tuners is None:
        return []
    lora = sys.modules.get("peft.tuners.lora.layer")
    linear = getattr(lora, "Linear", None)
    forward = source_key(linear) if linear is not None else None
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, tuners.BaseTunerLayer):
            continue
        why = None
        if linear is None or type(m) is not linear:
            why = (f"is a {type(m).__module__}.{type(m).__qualname__}; PEFT tuner layers are "
                   "taken as LoRA on a plain nn.Linear only")
        elif forward not in _LORA_FORWARDS or not all(hasattr(m, f) for f in _STATE):
            version = getattr(sys.modules.get("peft"), "__version__", "?")
            why = (f"is PEFT {version}'s LoRA Linear, whose forward (sha256 {forward}) is not "
                   "the one whose adapter state is known (PEFT 0.19 to 0.21)")
        elif type(m.get_base_layer()) is not nn.Linear:
            why = (f"wraps a {type(m.get_base_layer()).__qualname__}, not a plain nn.Linear "
                   "(a quantized or nested base)")
        elif getattr(m, "lora_variant", None):
            why = (f"has LoRA variants {sorted(m.lora_variant)} (DoRA and the like keep state "
                   "of their own)")
        elif not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                     for v in m.scaling.values()):
            why = "has a scaling that is not a number"
        if why:
            raise NotImplementedError(
                f"dspark_compile: PEFT layer {name!r} {why}; its forward's adapter state could "
                "change unseen under a captured graph, so the model is refused rather than "
                "verified wrong (merge_and_unload() folds the adapters into plain weights)")
        out.append((name, m))
    return out


class AdapterWatch:
    """The adapter state of ``layers`` (:func:`adapter_layers`) at the build, compared on every
    call by :meth:`changed`: one C-level read of the four fields and a tuple comparison a layer
    (17 us a call for 64 LoRA layers on a busy 2-core Xeon, ``timeit``)."""

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self._layers = layers
        self._read = operator.attrgetter(*_STATE)
        self._state = [tuple(copy.copy(v) for v in self._read(m)) for _, m in layers]

    def changed(self) -> str | None:
        """The first layer whose adapter state differs from the build's, with the fields that
        changed, as a phrase; None where none did."""
        read = self._read
        for (name, m), then in zip(self._layers, self._state):
            now = read(m)
            if now != then:
                fields = ", ".join(f"{f.lstrip('_')} {a!r} -> {b!r}"
                                   for f, a, b in zip(_STATE, then, now) if a != b)
                return f"PEFT layer {name!r} ({fields})"
        return None
