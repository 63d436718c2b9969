"""DBRX's experts captured as the ``dspark::experts_*`` ops.

``DbrxExperts`` does not go through transformers' experts interface (``frontend/experts.py``):
its forward loops over the experts the routing hit (data-dependent, refused by a capture) and
runs ``DbrxExpertGLU`` on each, with the weights stored flat, ``w1``, ``v1`` and ``w2`` of
``[E * F, D]`` each::

    out[t] = sum_k weights[t, k] * (act(x_t @ w1[e].T) * (x_t @ v1[e].T)) @ w2[e]

with ``e = ids[t, k]`` and ``w*[e]`` the ``[F, D]`` block of expert ``e``. While a model is
captured, :func:`dbrx_hooks` replaces ``DbrxExperts.forward`` with :func:`_forward`, which emits
one ``experts_route``, two ``experts_up`` (gate ``w1``, up ``v1``: ``[E, F, D]`` views, out by
in, no gate fused), the module's own activation and product as graph code, and one
``experts_down`` (``w2`` as ``[E, F, D]``, in by out: ``transposed``). No weight is copied: the
ops read the parameters through views.

Only the exact classes with forwards whose source this was derived from (transformers 5.24 and
5.17) are taken; anything else is refused naming the module.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..ops import experts as _experts_ops  # noqa: F401  (registers the dspark::experts_* ops)
from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward

__all__ = ["KNOWN_SOURCES", "dbrx_hooks"]

KNOWN_SOURCES = {"DbrxExperts": frozenset({"acae1549e65ba7b2", "1305608305ce33be"}),
                 "DbrxExpertGLU": frozenset({"d4dac21b0aac7bb3"})}
"""sha256 prefixes of the forwards this capture was derived from: transformers 5.24, and 5.17,
whose ``DbrxExperts.forward`` one-hot encodes the ids over ``E`` classes instead of ``E + 1``
(the same loop for every id the router can give, a top-k over ``E`` logits: ``[0, E)``)."""


def _forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """``DbrxExperts.forward`` as the experts ops (module docstring)."""
    glu = module.mlp
    e, f, d = module.num_experts, module.ffn_hidden_size, module.hidden_size
    rows = hidden_states.reshape(-1, d)
    ids = top_k_index.reshape(rows.shape[0], -1)
    weights = top_k_weights.reshape(ids.shape)
    ops = torch.ops.dspark
    order, offsets = ops.experts_route(ids, None, e)
    x = rows.to(glu.w1.dtype)
    gate = ops.experts_up(x, order, offsets, glu.w1.view(e, f, d), None, False, "none")
    up = ops.experts_up(x, order, offsets, glu.v1.view(e, f, d), None, False, "none")
    h = glu.activation_fn(gate) * up
    out = ops.experts_down(h, order, offsets, weights, glu.w2.view(e, f, d), None, True)
    return out.to(hidden_states.dtype).view(hidden_states.shape[0], -1, d)


@contextlib.contextmanager
def dbrx_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s DBRX experts as the experts ops for the capture; restored after."""
    classes, found = modeling_instances(model, "transformers.models.dbrx.modeling_dbrx",
                                        ("DbrxExperts", "DbrxExpertGLU"))
    if not found:
        yield
        return
    DbrxExperts, DbrxExpertGLU = classes
    for m in found:
        known = known_forward(m, DbrxExperts, KNOWN_SOURCES["DbrxExperts"]) and \
            known_forward(m.mlp, DbrxExpertGLU, KNOWN_SOURCES["DbrxExpertGLU"])
        if not known or not {p.dtype for p in (m.mlp.w1, m.mlp.v1, m.mlp.w2)} <= PLAIN_FLOATS:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: DBRX's experts are captured "
                "from DbrxExperts and DbrxExpertGLU's own forwards (transformers 5.24, 5.17) with "
                "plain float weights only, and these read otherwise; the model is refused "
                "rather than verified wrong")
    with swapped_forward(DbrxExperts, _forward):
        yield
