"""The weights a verifier's graphs bind, and the per-call check that the model still holds them.

The packed and dense graphs take the model's parameters and buffers as inputs, bound by name
when the verifier is built (``concat_linears`` also stacks some of them into one buffer and
rebinds the parts as row views of it); tier graphs captured later read the same addresses.
Three ways an engine can change weights under a built verifier, and what each needs:

- in place (``load_state_dict``, ``param.copy_``, a LoRA delta added to the weights by hand):
  the bound tensors and the captured addresses see the new values. Nothing to do.
- a parameter, buffer or submodule *replaced* (``module.weight = nn.Parameter(...)``, a LoRA
  or quantisation module swapped in, RL weight sync by assignment): the graphs would go on
  reading the old tensors. torch's global registration hooks bump a counter when any module of
  the model registers a parameter, buffer or submodule; the next call then compares every bound
  name with the model's own (one walk of the model) and refuses on a difference. A tensor held
  under several names (an LM head tied to the embedding) is watched under each: giving one of
  them a tensor of its own (an untie) is a replacement.
- a storage move (``model.to()``, ``.half()``, ``param.data = ...``): the object is the same,
  its storage is not. Every call compares the bound tensors' ``data_ptr`` with those at build
  (~57 ns a tensor on a 2-core Xeon: ~1 us for a 2-layer model, ~8.5 us for the 147 tensors of
  the 16-layer 1.1B benchmark model).

A refusal is ``StaleWeightsError`` naming the tensor; ``dspark_compile(model)`` again rebinds.

Not seen: writes to a module's ``_parameters`` dict itself, which bypass ``__setattr__`` (as
``model.to()`` does only under ``torch.__future__.set_overwrite_module_params_on_conversion``).

A PEFT LoRA layer's forward also reads Python state (adapters active, disabled, merged, their
scaling), which the graphs freeze: it is compared on every call (``frontend/peft.py``), and a
change is ``StaleWeightsError`` naming the layer. An in-place merge through PEFT
(``merge_adapter``) is such a change: it writes the base weight *and* stops the layer adding
the delta.

Forward hooks change what a module computes without touching its weights, and so does a
``forward`` set on a module instance (accelerate's ``add_hook_to_module``, which
``device_map`` placements across devices or offloading install, or a patch): both are refused
at the build like hooks, and after it (a forward set on an instance changes the size of the
module's attribute dict, or replaces an instance forward there was, which every call compares
before it walks the model). The verifier is the
model's forward captured once: a hook present at the build would be traced in with whatever
it closes over frozen (a steering vector scaled by a Python float, say), and one added later
would be missed, so the verify would no longer be the model's forward. ``dspark_compile``
refuses a model with forward hooks or pre-hooks (its own modules' or torch's global ones) with
``HookedModelError`` naming each; on every call the binding reads torch's hook-handle counter
(``RemovableHandle.next_id``, bumped by any hook registered anywhere) and, when it moved,
walks the model once and refuses a hook found on it. One hook is known inert and passes:
transformers' output recorder (``output_capturing_hook``), which a forward asked for hidden
states or attentions installs on the layers for good and which only appends to a list while
such a forward runs.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from ..frontend.peft import AdapterWatch, adapter_layers

__all__ = ["WeightBinding", "StaleWeightsError", "HookedModelError", "forward_hooks",
           "named_tensors", "refuse_hooks"]


class StaleWeightsError(RuntimeError):
    """The model's weights are no longer the tensors the verifier's graphs bind."""


class HookedModelError(RuntimeError):
    """The model runs forward hooks, which a verifier captured from its forward cannot follow."""


_INERT_HOOKS = {("transformers.utils.output_capturing", "output_capturing_hook")}
"""(module, function name) of hooks that change no value (module docstring)."""


def _inert(hook) -> bool:
    return (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) in _INERT_HOOKS


def _hook_name(hook) -> str:
    code = getattr(hook, "__code__", None)
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def forward_hooks(model: nn.Module) -> list[str]:
    """Every forward hook and pre-hook a call of ``model`` would run, but the known inert ones,
    one line each: where it is registered (a module path, or torch's global hooks) and the
    hook's name and source line."""
    found = [f"torch's global {kind} {_hook_name(h)}"
             for kind, hooks in (("forward pre-hook", nn_module._global_forward_pre_hooks),
                                 ("forward hook", nn_module._global_forward_hooks))
             for h in hooks.values() if not _inert(h)]
    for path, module in model.named_modules():
        for kind, hooks in (("forward pre-hook", module._forward_pre_hooks),
                            ("forward hook", module._forward_hooks)):
            found += [f"{path or type(model).__name__}'s {kind} {_hook_name(h)}"
                      for h in hooks.values() if not _inert(h)]
        own = module.__dict__.get("forward")  # the instance's own forward, not its class's
        plain = getattr(own, "__func__", None) is type(module).forward and \
            getattr(own, "__self__", None) is module  # a hook removed leaves the bound method
        if own is not None and not plain and not getattr(own, "dspark_route", False):
            how = (f"accelerate's {type(module._hf_hook).__qualname__}"
                   if hasattr(module, "_hf_hook") else _hook_name(module.__dict__["forward"]))
            found.append(f"{path or type(model).__name__}'s forward replaced on the instance "
                         f"({how})")
    return found


def _listed(found: list[str]) -> str:
    return "; ".join(found[:4]) + ("; ..." if len(found) > 4 else "")


def refuse_hooks(model: nn.Module) -> None:
    """Raise ``HookedModelError`` if calling ``model`` would run a forward hook (build time)."""
    found = forward_hooks(model)
    if found:
        raise HookedModelError(
            f"dspark_compile: {type(model).__name__} has {len(found)} forward hook(s): "
            f"{_listed(found)}. The verifier is the "
            "model's forward captured once, so a hook would be frozen as it computes now (with "
            "any Python state it reads) and one changed or added later missed: the model is "
            "refused rather than verified wrong. Remove the hooks before dspark_compile (a "
            "fixed change can live in the module's own forward, with its tensors as buffers)")


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by every name it has: a tensor held under two
    names (tied embeddings, a buffer registered twice) is listed under both."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


class WeightBinding:
    """Watches the model tensors ``names`` of ``weights`` (see the module docstring)."""

    def __init__(self, model: nn.Module, weights: dict[str, torch.Tensor], names,
                 unread=frozenset()) -> None:
        self.model = model
        own = named_tensors(model)
        bound = {id(weights[n]) for n in set(names) if n in own}
        # every name of a bound tensor: a tied name assigned its own tensor (an lm_head untied
        # from the embedding) leaves the graphs reading the shared one; but ``unread`` (names
        # the capture read through another, a longrope rotary's inv_freq)
        self._bound = {n: t for n, t in sorted(own.items())
                       if id(t) in bound and n not in unread}
        self._tensors = list(self._bound.values())
        self._ptrs = [t.data_ptr() for t in self._tensors]
        self._modules = {id(m) for m in model.modules()}
        self._snapshot_attributes()
        layers = adapter_layers(model)
        self._adapters = AdapterWatch(layers) if layers else None
        """PEFT adapter state the graphs froze (``frontend/peft.py``), None: no PEFT layer."""
        self._changes = 0  # bumped by the hooks when a module of the model registers anything
        self._seen = 0
        ref = weakref.ref(self)

        def hook(module, name, value):
            me = ref()
            if me is not None and id(module) in me._modules:
                me._changes += 1

        from torch.nn.modules import module as nn_module

        self._handles = [nn_module.register_module_parameter_registration_hook(hook),
                         nn_module.register_module_buffer_registration_hook(hook),
                         nn_module.register_module_module_registration_hook(hook)]
        weakref.finalize(self, _remove, list(self._handles))
        self._hook_mark = RemovableHandle.next_id  # after the registrations above

    def check(self) -> None:
        """Raise ``StaleWeightsError`` if a bound tensor was replaced or its storage moved,
        ``HookedModelError`` if the model gained a forward hook; ``StaleWeightsError`` too if a
        PEFT layer's adapter state changed."""
        if RemovableHandle.next_id != self._hook_mark or \
                sum(map(len, self._dicts)) != self._attributes or \
                any(d.get("forward") is not f for d, f in self._own_forwards):
            self._check_hooks()
        if self._changes != self._seen:
            self._check_names()
        if self._adapters is not None:
            what = self._adapters.changed()
            if what:
                raise StaleWeightsError(
                    f"dspark_compile: the adapter state of {what} changed since this verifier "
                    "was built (disable_adapter_layers, set_adapter, merge_adapter or "
                    "set_scale); the verifier's graphs froze it as it was, so a verify would "
                    "differ from the model. Restore it, or call dspark_compile(model) again")
        if list(map(torch.Tensor.data_ptr, self._tensors)) != self._ptrs:
            for (name, t), ptr in zip(self._bound.items(), self._ptrs):
                if t.data_ptr() != ptr:
                    raise StaleWeightsError(
                        f"dspark_compile: parameter {name} moved since this verifier was built "
                        f"(its storage was at {ptr:#x}, now {t.data_ptr():#x}, {t.dtype} on "
                        f"{t.device}): model.to(), .half(), .cuda(), assigning .data, or "
                        "another dspark_compile of this model that stacked its weights "
                        "(group_linears='concat' rebinds them as views of one buffer) leave "
                        "the verifier's stacked weights and tier graphs reading the old "
                        "tensors. Call dspark_compile(model) again after moving the model "
                        "(load_state_dict, which copies in place, needs no rebuild)")

    def _check_names(self) -> None:
        """One walk of the model: every bound name must still be the bound object."""
        seen = self._changes
        own = named_tensors(self.model)
        for name, t in self._bound.items():
            now = own.get(name)
            if now is not t:
                what = "is gone" if now is None else "was replaced by another tensor"
                raise StaleWeightsError(
                    f"dspark_compile: {name} {what} since this verifier was built (a "
                    "parameter, buffer or the submodule holding it assigned anew: a LoRA or "
                    "quantisation swap, weights synced by assignment); the verifier's graphs "
                    "still read the old tensor. Update weights in place (load_state_dict, "
                    "param.copy_) or call dspark_compile(model) again")
        self._modules = {id(m) for m in self.model.modules()}
        self._snapshot_attributes()
        self._seen = seen

    def _snapshot_attributes(self) -> None:
        """The modules' attribute dicts, their total size and the instance forwards there
        are (the bound methods a removed hook leaves): a forward set on an instance adds a
        key (accelerate's hook adds three) or replaces one of those, which ``check`` sees
        without a walk (2.6 us for the 215 modules of a 16-layer Llama on a 2-core Xeon)."""
        self._dicts = [m.__dict__ for m in self.model.modules()]
        self._attributes = sum(map(len, self._dicts))
        self._own_forwards = [(d, d["forward"]) for d in self._dicts if "forward" in d]

    def _check_hooks(self) -> None:
        """One walk of the model, after a hook was registered somewhere in the process or a
        module's attributes changed (a forward set on an instance)."""
        mark = RemovableHandle.next_id
        found = forward_hooks(self.model)
        if found:
            raise HookedModelError(
                f"dspark_compile: {_listed(found)} "
                "registered since this verifier was built; the verifier's graphs are the "
                "model's forward without it, so a verify would differ from the model. Remove "
                "the hook, or fold the change into the model and call dspark_compile(model) "
                "again")
        self._hook_mark = mark
        self._snapshot_attributes()


def _remove(handles) -> None:
    for h in handles:
        h.remove()
