"""LongCat-Flash's experts, routed and zero-compute, captured as the ``dspark::experts_*`` ops.

``LongcatFlashExperts`` does not go through transformers' experts interface: its forward loops
over the experts the routing hit (data-dependent, refused by a capture). Its router picks among
``E`` routed experts and ``Z`` zero-compute ones (ids ``E .. E + Z - 1``), which return the
token itself::

    out[t] = sum_k weights[t, k] * (ids[t, k] < E ? down[e] @ (act(gate) * up)(x_t) : x_t)

with ``gate | up = gate_up_proj[e] @ x_t`` (the two halves of ``[2F, D]``). While a model is
captured, :func:`longcat_hooks` replaces the forward with :func:`_forward`:

- one ``experts_route`` over the ``E`` routed experts: a zero-compute pick (an id past ``E``) is
  routed nowhere and adds nothing to the grouped sum;
- one ``experts_up`` on the first ``E`` rows of ``gate_up_proj`` (a view, no weight copied), the
  module's activation and product as graph code, one ``experts_down`` with the routing weights;
- the zero-compute picks as token-wise graph code: ``sum_k weights[t, k] * [ids[t, k] >= E] *
  x_t``, added to the routed sum.

HF adds each expert's rows into the output in expert order; the sums here run in another order,
so results agree to float rounding. Only the exact class with the forward this was derived from
(transformers 5.24 and 5.17, the same source) is taken; anything else, or a model with no routed
experts, is refused naming the module.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from ..ops import experts as _experts_ops  # noqa: F401  (registers the dspark::experts_* ops)
from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward

__all__ = ["KNOWN_SOURCES", "longcat_hooks"]

KNOWN_SOURCES = frozenset({"d59d2a7326e9fadd"})
"""sha256 prefixes of ``LongcatFlashExperts.forward`` sources this capture was derived from
(transformers 5.24 and 5.17 read the same)."""


def _forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """``LongcatFlashExperts.forward`` as the experts ops (module docstring)."""
    e = module.num_routed_experts
    ops = torch.ops.dspark
    order, offsets = ops.experts_route(top_k_index, None, e)
    w_up = module.gate_up_proj[:e]  # [E, 2F, D]: the zero-compute rows are never read
    x = hidden_states.to(w_up.dtype)
    gate, up = ops.experts_up(x, order, offsets, w_up, None, False, "none").chunk(2, dim=-1)
    h = module.act_fn(gate) * up
    routed = ops.experts_down(h, order, offsets, top_k_weights, module.down_proj, None, False)
    zero = (top_k_index >= e).to(top_k_weights.dtype) * top_k_weights  # [M, K]
    identity = (hidden_states[:, None, :] * zero[:, :, None]).sum(dim=1)
    return (routed.to(hidden_states.dtype) + identity.to(hidden_states.dtype))


@contextlib.contextmanager
def longcat_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s LongCat-Flash experts as the experts ops for the capture; restored
    after. A model without them is left untouched."""
    classes, found = modeling_instances(
        model, "transformers.models.longcat_flash.modeling_longcat_flash",
        ("LongcatFlashExperts",))
    if not found:
        yield
        return
    LongcatFlashExperts, = classes
    for m in found:
        routed = m.num_routed_experts > 0 and m.gate_up_proj is not None
        if not known_forward(m, LongcatFlashExperts, KNOWN_SOURCES) or not routed or \
                not {p.dtype for p in (m.gate_up_proj, m.down_proj)} <= PLAIN_FLOATS:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: LongCat-Flash's experts are "
                "captured from LongcatFlashExperts' own forward (transformers 5.24, 5.17) with "
                "routed experts of plain float weights only, and these read otherwise; the "
                "model is refused rather than verified wrong")
    with swapped_forward(LongcatFlashExperts, _forward):
        yield
