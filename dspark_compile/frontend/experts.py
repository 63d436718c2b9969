"""Hugging Face mixture-of-experts layers: capture their experts as the ``dspark::experts_*``
ops through transformers' experts interface.

transformers (5.x) decorates each family's experts class with ``@use_experts_implementation``:
its forward dispatches on ``config._experts_implementation`` through ``ExpertsInterface``, with
the class's layout as attributes (``has_gate``, ``has_bias``, ``is_transposed``,
``has_post_expert_norm``) and its weights as ``gate_up_proj`` / ``up_proj`` / ``down_proj``
(and ``*_bias``). Registering an implementation named ``"dspark"`` and setting it on the model
for the duration of a capture (as the attention goes through the attention interface) covers
every family that uses the decorator with no per-model code. The router's top-k before the
experts and any shared expert beside them stay the model's own graph code, which ``token_axis``
proves token-wise (DeepSeek's grouped, bias-corrected routing included) or refuses by line.

The implementation emits, per layer::

    order, offsets = experts_route(top_k_index, None, E)  # ragged_experts adds query_start_loc
    h = experts_up(x, order, offsets, w_up, b_up, transposed, activation)
    h = module._apply_gate(h)          # only when the gate is none of the fused activations
    out = experts_down(h, order, offsets, top_k_weights, w_down, b_down, transposed)

The gate is fused into ``experts_up`` only when the module's own ``_apply_gate`` is proven
equal to one of ``experts_reference.ACTIVATIONS`` by evaluating it on probe rows (bit for bit);
any other gate (GPT-OSS's clamped SwiGLU, a non-gated ``act_fn``) runs as the model's own code
between the two ops. What the interface passes beyond the three routing tensors, expert
parallelism and a post-expert norm are refused by name.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..ops import experts as _experts_ops  # noqa: F401  (registers the dspark::experts_* ops)
from ..ops.experts_reference import ACTIVATIONS, activate
from .scope import active_scope, outside_trace

__all__ = ["EXPERTS_NAME", "experts_hooks", "fused_activation"]

EXPERTS_NAME = "dspark"
"""Name of the implementation in transformers' ``ExpertsInterface``."""

_ARGUMENTS = (("hidden_states",), ("top_k_index", "router_indices"),
              ("top_k_weights", "routing_weights"))
"""Names each of the three routing tensors goes by (GPT-OSS calls them ``router_*``)."""


@contextlib.contextmanager
def experts_hooks(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s experts as the ``dspark::experts_*`` ops for the duration of a capture
    (nothing to do for a model whose classes do not use transformers' experts interface);
    the previous implementation is restored afterwards. A multimodal wrapper's inner text
    model is set where the wrapper's own class takes no implementation."""
    owners = _experts_owners(model)
    if not owners:
        yield
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_NAME, _dspark_experts)
    with contextlib.ExitStack() as stack:
        for owner in owners:
            getter = getattr(owner, "get_experts_implementation", None)  # transformers >= 5.24
            previous = getter() if getter is not None else owner.config._experts_implementation
            owner.set_experts_implementation(EXPERTS_NAME)
            stack.callback(owner.set_experts_implementation, previous)
        yield


def _takes_experts(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "_experts_implementation", None) is not None \
        and hasattr(module, "set_experts_implementation") and \
        module._can_set_experts_implementation()


def _experts_owners(model: nn.Module) -> list[nn.Module]:
    """The outermost modules of ``model`` whose class takes an experts implementation: the
    model itself, or, under a multimodal wrapper whose own class does not (Kimi-K2.5 around a
    DeepSeek-V3 text model), each such inner model."""
    if _takes_experts(model):
        return [model]
    owners: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not any(name.startswith(f"{outer}.") for outer, _ in owners) and \
                _takes_experts(module):
            owners.append((name, module))
    return [module for _, module in owners]


def _refuse(where: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{where}: {what}; the dspark experts ops implement transformers' experts layout "
        "(gate_up/up and down projections, optional biases, a gate, routing weights summed per "
        "token) only, so the model is refused rather than verified wrong")


def _arguments(where: str, args: tuple, kwargs: dict):
    """``(hidden [M, D], ids [M, K], weights [M, K])`` from what the interface passed."""
    values = list(args)
    if len(values) > len(_ARGUMENTS):
        raise _refuse(where, f"its experts are called with {len(values)} positional arguments")
    for names in _ARGUMENTS[len(values):]:
        found = [n for n in names if n in kwargs]
        if len(found) != 1:
            raise _refuse(where, f"its experts are called without {names[0]!r}")
        values.append(kwargs[found[0]])
    known = {n for names in _ARGUMENTS for n in names}
    extra = [k for k, v in kwargs.items() if k not in known and v is not None]
    if extra:
        raise _refuse(where, f"its experts are called with {extra}")
    hidden, ids, weights = values
    if hidden.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or \
            ids.is_floating_point() or not weights.is_floating_point():
        raise _refuse(where, f"its experts take hidden {tuple(hidden.shape)}, ids "
                      f"{ids.dtype} {tuple(ids.shape)} and weights {tuple(weights.shape)}, not "
                      "[M, D] rows with integer [M, K] ids and floating [M, K] weights")
    return hidden, ids, weights


def _tables(module: nn.Module, where: str):
    """``(w_up, b_up, w_down, b_down, transposed)`` of a decorated experts module."""
    if getattr(module, "_is_expert_parallel", False):
        raise _refuse(where, "it runs expert-parallel (experts sharded over ranks)")
    if getattr(module, "has_post_expert_norm", False):
        raise _refuse(where, "it normalises each expert's output before the routing weights "
                      "(has_post_expert_norm)")
    gated, biased = bool(module.has_gate), bool(module.has_bias)
    w_up = module.gate_up_proj if gated else module.up_proj
    b_up = (module.gate_up_proj_bias if gated else module.up_proj_bias) if biased else None
    b_down = module.down_proj_bias if biased else None
    plain = (torch.float32, torch.float16, torch.bfloat16)
    if w_up.dtype not in plain or module.down_proj.dtype not in plain:
        raise _refuse(where, f"its expert weights are {w_up.dtype} / {module.down_proj.dtype} "
                      "(quantized experts carry scales the ops do not read)")
    return w_up, b_up, module.down_proj, b_down, bool(module.is_transposed)


def _probe_rows(columns: int) -> torch.Tensor:
    """Probe rows for a gate over ``columns``: normal values, a sweep past any clamp a gate
    might apply (GPT-OSS clamps at 7), extremes and signed zeros."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(32, columns, generator=g) * 3,
            torch.linspace(-60.0, 60.0, 16 * columns).reshape(16, columns),
            torch.tensor([1e4, -1e4, 0.0, -0.0, 1e-30, -1e-30]).repeat(columns).reshape(
                -1, columns)]
    return torch.cat(rows)


def fused_activation(module: nn.Module, columns: int) -> str:
    """The :data:`ACTIVATIONS` entry the module's gate equals bit for bit on probe rows of
    ``columns`` (its up projection's width), or ``"none"``: the gate then runs as the model's
    own graph code between the two ops. Evaluated on real tensors, outside any trace."""
    if not module.has_gate or columns % 2:
        return "none"
    with outside_trace(), torch.no_grad():
        probe = _probe_rows(columns)
        try:
            want = module._apply_gate(probe)
        except Exception:  # a gate that reads (fake) parameters: not one of ours
            return "none"
        for name in ACTIVATIONS[1:]:
            got = activate(probe, name)
            if isinstance(want, torch.Tensor) and want.shape == got.shape and \
                    torch.equal(want, got):
                return name
    return "none"


def _dspark_experts(self: nn.Module, *args, **kwargs) -> torch.Tensor:
    """transformers experts implementation: ``hidden [M, D], ids [M, K], weights [M, K] ->
    [M, D]`` as ``experts_route`` / ``experts_up`` / ``experts_down`` (module docstring)."""
    scope = active_scope()
    if scope is None:
        raise RuntimeError(
            f"experts implementation {EXPERTS_NAME!r} runs only inside a dspark_compile "
            "capture; set the model back with model.set_experts_implementation('grouped_mm')")
    where = f"experts {scope.site_names.get(id(self), type(self).__name__)}"
    hidden, ids, weights = _arguments(where, args, kwargs)
    w_up, b_up, w_down, b_down, transposed = _tables(self, where)
    columns = w_up.shape[2] if transposed else w_up.shape[1]
    activation = fused_activation(self, columns)
    ops = torch.ops.dspark
    order, offsets = ops.experts_route(ids, None, w_up.shape[0])
    h = ops.experts_up(hidden.to(w_up.dtype), order, offsets, w_up, b_up, transposed,
                       activation)
    if activation == "none":
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = ops.experts_down(h.to(w_down.dtype), order, offsets, weights, w_down, b_down,
                           transposed)
    return out.to(hidden.dtype)
