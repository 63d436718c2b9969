"""Inkling 2's layers that a cache-less capture cannot trace as written, each replaced for the
capture by exact class and source (transformers 5.24; 5.17 has no Inkling 2). Inkling 2 Loop's
modeling module holds the same classes under its own prefix, with the same sources, and one
more (its message residual); a looped layer's modules run once per pass, each run a layer of
the capture with KV and conv states of its own.

- ``Inkling2RelativePositionBias`` gathers each query's relative logits over distances HF
  computes from its cache offsets (``get_relative_distance``: ``0 .. T - 1`` without a cache).
  Replaced, it returns the logits themselves (``[bs, H, T, E]``, after the model's own clip
  and log scale by each token's position) as :class:`~.relative.RelativeLogits`, which the
  attention function hands to ``dspark::ragged_attention`` as ``rel``.
- The attention's ``sinks`` (``sink_proj(hidden)``: one logit per token and head, joined to the
  softmax as an extra column by the model's own eager function) are taken by the attention
  function only from the known attention classes (:func:`row_sinks_module`), as ``[bs, H, T]``.
- ``Inkling2DynamicShortConvolution`` (the full layers' K and V convolutions: taps of static
  weights plus weights projected from each token, shared within a head) reads a window of the
  past ``W - 1`` inputs by padding and unfolding the block: no state across steps. Replaced, the
  window comes from one causal depthwise conv over the input repeated ``W`` times with one-hot
  taps (``hybrid.window``, so the capture owns its ``W * C`` channel state like any short conv:
  ``W`` times the state of a static conv), and the per-token taps are graph code.
- ``Inkling2BlockAttentionResidual`` (and Inkling 2 Loop's ``MessageAttentionResidual``, one
  query per message of each looped layer) mixes each token's block states through the attention
  interface with ``is_causal=False`` over the blocks (not the tokens). Replaced, that attention
  is the eager softmax it computes, token by token, as graph code.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import nn

from .hybrid import WINDOW_MODULES, one_hot_taps, window
from .relative import RelativeLogits
from .replaced import PLAIN_FLOATS, known_forward, source_key, swapped_forward

__all__ = ["KNOWN_SOURCES", "inkling2_hooks", "row_sinks_module"]

KNOWN_SOURCES = {
    "RelativePositionBias": frozenset({"55b2f2f777126056"}),
    "DynamicShortConvolution": frozenset({"55d4c0545c4995ac"}),
    "BlockAttentionResidual": frozenset({"71ff309947e33f69"}),
    "MessageAttentionResidual": frozenset({"14773c51f8cd6170"}),
    "SlidingAttention": frozenset({"f7ea05668f9689e2"}),
    "FullAttention": frozenset({"cfb9f989554f810a"}),
    "eager_attention_forward": frozenset({"e356c83147edb3b7"}),
}
"""sha256 prefixes of the sources this capture was derived from (transformers 5.24), by class
name past the modeling module's prefix."""

_MODELING = {"transformers.models.inkling2.modeling_inkling2": "Inkling2",
             "transformers.models.inkling2_loop.modeling_inkling2_loop": "Inkling2Loop"}
"""Modeling modules -> their class-name prefix."""


def _role(module: nn.Module) -> tuple[object, str] | None:
    """``(modeling module, role)`` of one of the known Inkling 2 classes, else None."""
    cls = type(module)
    prefix = _MODELING.get(cls.__module__)
    modeling = sys.modules.get(cls.__module__)
    if prefix is None or modeling is None or not cls.__name__.startswith(prefix):
        return None
    role = cls.__name__[len(prefix):]
    return (modeling, role) if getattr(modeling, cls.__name__, None) is cls else None


def _relative_forward(self, hidden_states, relative_distance, position_ids):
    """``Inkling2RelativePositionBias.forward``: the logits a distance, not gathered."""
    relative_states = self.linear(hidden_states).view(*hidden_states.shape[:-1],
                                                      self.num_heads, -1)
    relative_states = self.norm(relative_states, position_ids)
    return RelativeLogits((relative_states @ self.proj).transpose(1, 2))


def _dynamic_conv_forward(self, hidden_states, dynamic_input, cache=None, conv_mask=None,
                          cache_offset: int = 0, **kwargs):
    """``Inkling2DynamicShortConvolution.forward`` with its window from a capture-owned conv."""
    if cache is not None or kwargs.get("seq_idx") is not None:
        raise NotImplementedError(
            f"{type(self).__name__}: called with a cache or seq_idx; the capture runs "
            "use_cache=False over whole requests and owns the conv state")
    modeling = sys.modules[type(self).__module__]  # its padding mask helper
    input_dtype = hidden_states.dtype
    batch_size, seq_len, hidden_size = hidden_states.shape
    width = self.conv_kernel_size
    dynamic_weights = self.weight_proj(dynamic_input).float()
    dynamic_weights = dynamic_weights.view(batch_size, seq_len, self.num_heads, 1, width)
    weights = self.static_weight.float().T.view(self.num_heads, -1, width) + dynamic_weights
    hidden_states = hidden_states.float()
    # channel lag * C + c of the conv's output is channel c of the token `lag` steps back
    lags = torch.arange(width, device=hidden_states.device).repeat_interleave(hidden_size)
    context = modeling.apply_mask_to_padding_states(hidden_states, conv_mask)
    context = context.transpose(1, 2).repeat(1, width, 1)  # [bs, W * C, T]
    windows = window(context, one_hot_taps(lags, width, torch.float32))
    windows = windows.view(batch_size, width, hidden_size, seq_len).permute(0, 3, 2, 1)
    windows = windows.reshape(batch_size, seq_len, self.num_heads, -1, width)
    out = (windows * weights).sum(-1).reshape(batch_size, seq_len, hidden_size)
    out = (out + hidden_states) / (2 * width + 1) ** 0.5
    return out.to(input_dtype)


def _over_blocks(module, block_states, partial_block_states, queries):
    """The residual's eager attention (``is_causal=False``, no mask) of ``queries [Q, D]`` (the
    same at every token) over each token's normed blocks, token by token: ``[bs, T, Q, D]``."""
    stacked = torch.cat([block_states, partial_block_states.unsqueeze(-2)], dim=-2).float()
    stacked = module.norm(stacked)  # [bs, T, blocks, D]
    scores = torch.matmul(queries.float(), stacked.transpose(-1, -2)) * stacked.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32), stacked)


def _block_residual_forward(self, block_states, partial_block_states):
    """``Inkling2BlockAttentionResidual.forward``: one output per query, unbound."""
    queries = self.query.view(-1, block_states.shape[-1])
    return _over_blocks(self, block_states, partial_block_states, queries).unbind(-2)


def _message_residual_forward(self, block_states, partial_block_states, loop_layer_idx: int):
    """``Inkling2LoopMessageAttentionResidual.forward``: the looped layer's four message
    queries; ``[bs, T, 4, D]``."""
    return _over_blocks(self, block_states, partial_block_states, self.query[loop_layer_idx])


def row_sinks_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of Inkling 2's attention classes with a known forward, whose
    modeling module's eager attention (what ``sinks=`` means) is known too."""
    found = _role(module)
    if found is None or found[1] not in ("SlidingAttention", "FullAttention"):
        return False
    modeling, role = found
    return known_forward(module, type(module), KNOWN_SOURCES[role]) and _eager_known(modeling)


def _eager_known(modeling) -> bool:
    """The modeling module's eager attention (what ``sinks=`` means there) is the known one."""
    return source_key(modeling, "eager_attention_forward") in \
        KNOWN_SOURCES["eager_attention_forward"]


_REPLACED = {"RelativePositionBias": _relative_forward,
             "DynamicShortConvolution": _dynamic_conv_forward,
             "BlockAttentionResidual": _block_residual_forward,
             "MessageAttentionResidual": _message_residual_forward}
"""Role -> the forward that replaces it for the capture."""

WINDOW_MODULES.update(f"{module}.{prefix}DynamicShortConvolution"
                      for module, prefix in _MODELING.items())


@contextlib.contextmanager
def inkling2_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Replace Inkling 2's relative bias, dynamic convolutions and block residuals for the
    capture (module docstring); restored after. A model without them is left untouched."""
    found = {}
    for m in model.modules():
        role = _role(m)
        if role is None or role[1] not in _REPLACED:
            continue
        weights = [p.dtype for p in m.parameters(recurse=False)]
        if not known_forward(m, type(m), KNOWN_SOURCES[role[1]]) or \
                not set(weights) <= PLAIN_FLOATS:
            name = type(m).__name__
            raise NotImplementedError(
                f"{name} {names.get(id(m), '?')!r}: Inkling 2's {name} is captured from its own "
                f"forward (transformers 5.24, source {source_key(type(m))}) with plain float "
                "weights only, and this one reads otherwise; the model is refused rather than "
                "verified wrong")
        found[type(m)] = _REPLACED[role[1]]
    with contextlib.ExitStack() as stack:
        for cls, forward in found.items():
            stack.enter_context(swapped_forward(cls, forward))
        yield
