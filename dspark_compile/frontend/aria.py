"""Aria's experts as transformers 5.17 writes them, captured as the ``dspark::experts_*`` ops.

In transformers 5.17 ``AriaExperts.forward`` routes with ``route_tokens_to_experts`` (a top-k
of the router's logits, softmax over the k kept), sorts the token-expert pairs by expert and
runs its two ``AriaGroupedExpertsGemm`` (weights ``[E, in, out]``) through
``sequential_experts_gemm``, which loops over the experts with the counts on the host: a
data-dependent loop no capture holds. What it computes is::

    out[t] = sum_k weights[t, k] * (silu(p) * g) @ fc2[e]      with [p | g] = x_t @ fc1[e]

with ``e = ids[t, k]``, the product per pair and then the sum over ``k`` (the unpermuted rows
times their weights, summed). While a model is captured, :func:`aria_hooks` replaces
``AriaExperts.forward`` with :func:`_forward`: the routing as written (graph code), one
``experts_route``, ``experts_up`` over ``fc1`` and ``experts_down`` over ``fc2`` (both in by
out: ``transposed``), the SiLU product between them as graph code. No weight is copied.

transformers 5.24's Aria goes through the experts interface (``frontend/experts.py``) and
needs nothing here. Only 5.17's exact classes and forwards are taken, with plain float
weights; another form of them is refused naming the module.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..ops import experts as _experts_ops  # noqa: F401  (registers the dspark::experts_* ops)
from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward

__all__ = ["KNOWN_SOURCES", "aria_hooks"]

KNOWN_SOURCES = {
    ("AriaExperts", "forward"): frozenset({"a5dd0aeda005146b"}),
    ("AriaExperts", "route_tokens_to_experts"): frozenset({"477891657203dc93"}),
    ("AriaGroupedExpertsGemm", "forward"): frozenset({"05bcac49de0bffc2"}),
}
"""sha256 prefixes (``source_key``) of transformers 5.17's sources this was derived from."""


def _forward(module: nn.Module, hidden_states: torch.Tensor,
             router_logits: torch.Tensor) -> torch.Tensor:
    """``AriaExperts.forward`` (5.17) as the experts ops (module docstring)."""
    ids, weights = module.route_tokens_to_experts(router_logits)
    e = module.config.moe_num_experts
    ops = torch.ops.dspark
    order, offsets = ops.experts_route(ids, None, e)
    x = hidden_states.to(module.fc1.weight.dtype)
    y = ops.experts_up(x, order, offsets, module.fc1.weight, None, True, "none")
    projection, gate = torch.chunk(y, 2, dim=-1)
    h = nn.functional.silu(projection) * gate
    out = ops.experts_down(h, order, offsets, weights, module.fc2.weight, None, True)
    return out.to(hidden_states.dtype)


@contextlib.contextmanager
def aria_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s 5.17 Aria experts as the experts ops for the capture; restored after.
    A model without them (or with 5.24's) is left untouched."""
    classes, found = modeling_instances(model, "transformers.models.aria.modeling_aria",
                                        ("AriaExperts", "AriaGroupedExpertsGemm"))
    if not found or not hasattr(classes[0], "route_tokens_to_experts"):
        yield
        return
    experts, gemm = classes
    for m in found:
        known = all(known_forward(m, experts, KNOWN_SOURCES[("AriaExperts", method)], method)
                    for method in ("forward", "route_tokens_to_experts")) and \
            all(known_forward(g, gemm, KNOWN_SOURCES[("AriaGroupedExpertsGemm", "forward")])
                for g in (m.fc1, m.fc2)) and \
            {m.fc1.weight.dtype, m.fc2.weight.dtype} <= PLAIN_FLOATS
        if not known:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: Aria's experts are captured "
                "from AriaExperts' and AriaGroupedExpertsGemm's own forwards (transformers "
                "5.17) with plain float weights only, and these read otherwise; the model is "
                "refused rather than verified wrong")
    with swapped_forward(experts, _forward):
        yield
