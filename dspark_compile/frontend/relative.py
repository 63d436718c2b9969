"""Relative position logits (Inkling): each query row's own logit per backward distance, added
to its attention scores, captured as ``rel`` of ``dspark::ragged_attention``.

``InklingAttention`` projects every token to ``relative_states [T, H, d_rel]`` and mixes a
trained bank ``proj [d_rel, E]`` into one logit per distance: ``rel = relative_states @ proj``
(``[T, H, E]``, token-wise). HF materialises ``position_bias[h, i, j] = rel[i, h, p_i - p_j]``
for ``0 <= p_i - p_j < E`` (0 past it) over the positions it computes from its cache offsets,
and adds it after the scaling. Full layers also scale queries and logits by ``tau = 1 + alpha *
log(max((p + 1) / n_floor, 1))`` of the query's position.

The capture runs ``use_cache=False``, so HF's own positions would be ``0 .. T - 1`` of the
verify block. While a model is captured, :func:`relative_hooks` replaces
``InklingAttention.forward`` with :func:`_forward`, the same computation with each token's
position taken from the capture's positions: the projections, norms and short convolutions
(``InklingShortConvolution``, captured as conv layers of their own) stay the module's graph
code, ``rel`` is passed to the attention function as :class:`RelativeLogits`, and the
attention function (``_hf_attention``) hands it to ``dspark::dense_cached_attention``; any
other ``position_bias`` is refused by name there. Only the exact classes with the forward
sources this was derived from (transformers 5.24 and 5.17) are taken.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward
from .scope import active_scope

__all__ = ["KNOWN_SOURCES", "RelativeLogits", "relative_hooks"]

KNOWN_SOURCES = {
    "InklingAttention": frozenset({"f6ccf3041597db63", "d23daa82f5c92933"}),
    "InklingRelativeLogits": frozenset({"252e09d1807c2d05"}),
}
"""sha256 prefixes of the forwards this capture was derived from (transformers 5.24, 5.17:
the cache keyword's name and nothing else differs)."""


@dataclass(frozen=True)
class RelativeLogits:
    """What the replaced forward passes as ``position_bias``: ``logits [bs, H, T, E]``, a query
    row's logit per distance ``0 .. E - 1`` (the attention function's ``rel``)."""

    logits: torch.Tensor


def _refuse(module, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{type(module).__name__}: {what}; dspark_compile captures Inkling's attention from "
        "its own forward only, so the model is refused rather than verified wrong")


def _forward(self, hidden_states: torch.Tensor, attention_mask=None, conv_mask=None,
             cache=None, past_key_values=None, **kwargs):
    """``InklingAttention.forward`` with the capture's positions (module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if cache is not None or past_key_values is not None:
        raise _refuse(self, "it is called with a cache (the capture runs use_cache=False and "
                            "owns the KV and conv states)")
    scope = active_scope()
    if scope is None or scope.positions is None:
        raise RuntimeError("Inkling's attention was replaced by dspark_compile and runs only "
                           "inside a capture")
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states)
    key_states = self.k_sconv(self.k_proj(hidden_states), conv_mask=conv_mask)
    value_states = self.v_sconv(self.v_proj(hidden_states), conv_mask=conv_mask)
    relative_states = self.r_proj(hidden_states)
    query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(key_states.view(hidden_shape)).transpose(1, 2)
    value_states = value_states.view(hidden_shape).transpose(1, 2)
    relative_states = relative_states.view(*input_shape, self.num_heads, -1)
    rel = (relative_states @ self.rel_logits_proj.proj).transpose(1, 2)  # [bs, H, T, E]
    if not self.is_sliding and self.config.log_scaling_n_floor is not None:
        effective_n = (scope.positions + 1).float()  # [bs, T]: each token's own position
        tau = 1.0 + self.config.log_scaling_alpha * torch.log(
            (effective_n / self.config.log_scaling_n_floor).clamp(min=1.0))
        tau = tau[:, None, :, None]
        query_states = (query_states.float() * tau).to(query_states.dtype)
        rel = (rel.float() * tau).to(rel.dtype)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if attention is None:
        raise _refuse(self, f"its attention implementation "
                            f"{self.config._attn_implementation!r} is not dspark_compile's")
    attn_output, attn_weights = attention(
        self, query_states, key_states, value_states, attention_mask, dropout=0.0,
        scaling=self.scaling, sliding_window=self.sliding_window,
        position_bias=RelativeLogits(rel), **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


@contextlib.contextmanager
def relative_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s Inkling attention with its relative logits handed to the attention
    function for the capture; restored after. A model without it is left untouched."""
    classes, found = modeling_instances(model, "transformers.models.inkling.modeling_inkling",
                                        ("InklingAttention", "InklingRelativeLogits"))
    if not found:
        yield
        return
    InklingAttention, InklingRelativeLogits = classes
    for m in found:
        known = known_forward(m, InklingAttention, KNOWN_SOURCES["InklingAttention"]) and \
            known_forward(m.rel_logits_proj, InklingRelativeLogits,
                          KNOWN_SOURCES["InklingRelativeLogits"]) and \
            m.rel_logits_proj.proj.dtype in PLAIN_FLOATS and \
            m.rel_logits_proj.rel_extent == m.rel_logits_proj.proj.shape[1]
        if not known or m.training:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: Inkling's attention is captured "
                "from InklingAttention and InklingRelativeLogits' own forwards (transformers "
                "5.24, 5.17) with plain float weights only, and these read otherwise; the model "
                "is refused rather than verified wrong")
    with swapped_forward(InklingAttention, _forward):
        yield
