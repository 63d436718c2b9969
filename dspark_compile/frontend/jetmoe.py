"""JetMoE's mixture of experts and mixture of attention heads, captured as the
``dspark::experts_*`` ops.

JetMoE routes twice a layer, each time through a ``JetMoeTopKGating`` (softmax over the top-k
router logits, computed in float32 and cast to the hidden states' dtype) and two
``JetMoeParallelExperts`` (weights ``[E, out, in]``):

- ``JetMoeMoE`` (the MLP): ``out[t] = sum_k g[t, k] * W2[e] @ (act(a) * b) + bias`` with
  ``a | b = W1[e] @ x_t`` (the two halves of ``[2F, D]``);
- ``JetMoeMoA`` (the attention): ``map`` projects each token's query once per chosen expert
  (``[B, T, K, hidden]``: the ``K`` slots become ``K`` groups of query heads), ``reduce`` projects
  each slot's attention output back through the same expert and sums them with the gates.

HF sorts the token-slot pairs by expert with ``expert_size.tolist()`` and splits the rows on the
host (data-dependent, refused by a capture). While a model is captured, :func:`jetmoe_hooks`
replaces ``JetMoeMoE.forward``, ``JetMoeMoA.map`` and ``JetMoeMoA.reduce``: the router's top-k
and softmax stay graph code (token-wise), the pairs are grouped by ``experts_route``, the
projections run as ``experts_up`` (``map``'s queries come back in pair order, ``n * K + k``, the
layout HF's ``map`` returns) and ``experts_down`` (the gated sum), the activation and product as
the module's own graph code. No weight is copied.

``JetMoeAttention`` tiles its K and V ``K`` times so that query head ``k * Hkv + j`` (slot
``k``'s head ``j``) reads KV head ``j``; stored as passed, the KV cache would hold every head
``K`` times. ``JetMoeAttention.forward`` is replaced too: the same attention with the query
heads regrouped by KV head (head ``j * K + k``, the grouping ``dspark::ragged_attention`` reads)
over the untiled K and V, and the output put back in slot order: each head computes what it did,
and the cache holds each KV head once.

HF adds each pair's rows in expert order; the sums here run in another order, so results agree
to float rounding. Only the exact classes with the sources this was derived from (transformers
5.24 and 5.17 read the same) are taken; anything else is refused naming the module.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

from ..ops import experts as _experts_ops  # noqa: F401  (registers the dspark::experts_* ops)
from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward

__all__ = ["KNOWN_SOURCES", "jetmoe_hooks"]

KNOWN_SOURCES = {
    ("JetMoeMoE", "forward"): frozenset({"8175d8c8fa24a126"}),
    ("JetMoeMoA", "map"): frozenset({"3263d7e0718023d7"}),
    ("JetMoeMoA", "reduce"): frozenset({"f8e309330b152917"}),
    ("JetMoeTopKGating", "forward"): frozenset({"a83a4201867ddc15"}),
    ("JetMoeParallelExperts", "forward"): frozenset({"8b3dc71286eb7c1a"}),
    ("JetMoeAttention", "forward"): frozenset({"41906daf27373618", "8f588ea5360c43dc"}),
}
"""sha256 prefixes of the sources this capture was derived from, per (class, method)."""


def _route(router: nn.Module, rows: torch.Tensor):
    """``JetMoeTopKGating``'s decision, token by token: ``(ids [M, K], gates [M, K], logits)``."""
    logits = router.layer(rows).float()
    top_logits, ids = logits.topk(router.top_k, dim=1)
    gates = torch.softmax(top_logits, dim=1).type_as(rows)
    return ids, gates, logits


def _moe_forward(module: nn.Module, layer_input: torch.Tensor) -> torch.Tensor:
    """``JetMoeMoE.forward`` as the experts ops (module docstring)."""
    bsz, length, d = layer_input.shape
    rows = layer_input.reshape(-1, d)
    ids, gates, _ = _route(module.router, rows)
    ops = torch.ops.dspark
    order, offsets = ops.experts_route(ids, None, module.input_linear.num_experts)
    w_up, w_down = module.input_linear.weight, module.output_linear.weight
    a, b = ops.experts_up(rows.to(w_up.dtype), order, offsets, w_up, None, False,
                          "none").chunk(2, dim=-1)
    h = module.activation(a) * b
    out = ops.experts_down(h, order, offsets, gates, w_down, None, False)
    return out.to(layer_input.dtype).view(bsz, length, d) + module.bias


def _moa_map(module: nn.Module, layer_input: torch.Tensor):
    """``JetMoeMoA.map``: each token's query through each of its experts, ``[B, T, K, hidden]``,
    with the router logits and the routing the matching :func:`_moa_reduce` reads."""
    bsz, length, d = layer_input.shape
    rows = layer_input.reshape(-1, d)
    ids, gates, logits = _route(module.router, rows)
    ops = torch.ops.dspark
    order, offsets = ops.experts_route(ids, None, module.num_experts)
    w = module.input_linear.weight
    queries = ops.experts_up(rows.to(w.dtype), order, offsets, w, None, False, "none")
    return queries.view(bsz, length, module.top_k, -1), logits, (order, offsets, gates)


def _moa_reduce(module: nn.Module, layer_input: torch.Tensor, topo_info) -> torch.Tensor:
    """``JetMoeMoA.reduce``: each slot's output through its expert, summed with the gates."""
    bsz, length, k, hidden = layer_input.shape
    order, offsets, gates = topo_info
    w = module.output_linear.weight
    out = torch.ops.dspark.experts_down(layer_input.reshape(-1, hidden).to(w.dtype), order,
                                        offsets, gates, w, None, False)
    return out.to(layer_input.dtype).view(bsz, length, module.input_size) + module.bias


def _by_kv_head(query_states: torch.Tensor, top_k: int, kv_heads: int) -> torch.Tensor:
    """``[bs, K * Hkv, T, d]`` (head ``k * Hkv + j``) -> ``[bs, Hkv * K, T, d]`` (head ``j * K +
    k``): each query head next to the others that read its KV head."""
    bs, _, t, d = query_states.shape
    return query_states.view(bs, top_k, kv_heads, t, d).transpose(1, 2).reshape(
        bs, kv_heads * top_k, t, d)


def _attention_forward(self, hidden_states: torch.Tensor, attention_mask=None,
                       position_embeddings=None, cache=None, past_key_values=None, **kwargs):
    """``JetMoeAttention.forward`` over untiled K and V (module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if cache is not None or past_key_values is not None:
        raise NotImplementedError(f"{type(self).__name__}: called with a cache; the capture "
                                  "runs use_cache=False and owns the KV")
    modeling = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states, router_logits, topo_info = self.experts.map(hidden_states)
    key_states, value_states = self.kv_proj(hidden_states).chunk(2, dim=-1)
    query_states = query_states.view(hidden_shape).transpose(1, 2)  # head k * Hkv + j
    key_states = key_states.view(hidden_shape).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = modeling.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    kv_heads, d = key_states.shape[1], key_states.shape[-1]
    query_states = _by_kv_head(query_states, self.top_k, kv_heads)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    attn_output, attn_weights = attention(self, query_states, key_states, value_states,
                                          attention_mask, dropout=0.0, scaling=self.scaling,
                                          **kwargs)
    attn_output = attn_output.view(*input_shape, kv_heads, self.top_k, d).transpose(-3, -2)
    attn_output = self.experts.reduce(attn_output.reshape(*input_shape, self.top_k, -1),
                                      topo_info)
    return attn_output.view(*input_shape, -1), attn_weights, router_logits


def _known(m: nn.Module, cls: type, method: str) -> bool:
    return known_forward(m, cls, KNOWN_SOURCES[(cls.__name__, method)], method)


@contextlib.contextmanager
def jetmoe_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s JetMoE experts (MLP and attention) as the experts ops for the capture;
    restored after. A model without them is left untouched."""
    classes, found = modeling_instances(model, "transformers.models.jetmoe.modeling_jetmoe",
                                        ("JetMoeMoE", "JetMoeMoA", "JetMoeAttention",
                                         "JetMoeParallelExperts", "JetMoeTopKGating"), held=3)
    if not found:
        yield
        return
    JetMoeMoE, JetMoeMoA, JetMoeAttention, JetMoeParallelExperts, JetMoeTopKGating = classes
    for m in found:
        if isinstance(m, JetMoeAttention):
            if not _known(m, JetMoeAttention, "forward") or not isinstance(m.experts, JetMoeMoA):
                raise NotImplementedError(
                    f"JetMoeAttention {names.get(id(m), '?')!r}: JetMoE's attention is captured "
                    "from its own forward (transformers 5.24, 5.17) only, and this one reads "
                    "otherwise; the model is refused rather than verified wrong")
            continue
        own = [(JetMoeMoE, "forward")] if isinstance(m, JetMoeMoE) else \
            [(JetMoeMoA, "map"), (JetMoeMoA, "reduce")]
        parts = [m.input_linear, m.output_linear]
        known = all(_known(m, cls, meth) for cls, meth in own) and \
            _known(m.router, JetMoeTopKGating, "forward") and \
            all(_known(p, JetMoeParallelExperts, "forward") for p in parts) and \
            {p.weight.dtype for p in parts} <= PLAIN_FLOATS
        if not known:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: JetMoE's experts are captured "
                "from the JetMoeMoE, JetMoeMoA, JetMoeTopKGating and JetMoeParallelExperts "
                "sources of transformers 5.24 and 5.17 with plain float weights only, and these "
                "read otherwise; the model is refused rather than verified wrong")
    with swapped_forward(JetMoeMoE, _moe_forward), \
            swapped_forward(JetMoeMoA, _moa_map, "map"), \
            swapped_forward(JetMoeMoA, _moa_reduce, "reduce"), \
            swapped_forward(JetMoeAttention, _attention_forward):
        yield
