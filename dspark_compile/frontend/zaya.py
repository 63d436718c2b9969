"""ZAYA's compressed convolutional attention (CCA) projection, with its windows owned by the
capture.

``ZayaCCAProjection`` mixes each token's query and key channels with the ``K = (k0 - 1) + (k1 -
1)`` tokens before it: a depthwise ``nn.Conv1d`` of ``k0`` taps, then a conv of ``k1`` taps
grouped by head (channels of one head mix), both with biases, over the block zero-padded by
``K`` on the left (HF's state: the last ``K`` inputs). Its values take half of each head from the
token and half from the token before it (``v_proj_delayed`` of the previous token;
``v_proj_delayed`` of zeros before the first). Run over a verify block without a cache, both
would start from zeros.

While a model is captured, :func:`zaya_hooks` replaces the forward with :func:`_forward`: one
window conv (``hybrid.window``, a conv layer whose state the capture owns) over the query and
key channels repeated ``K + 1`` times (one-hot taps at lags ``0 .. K``) and the delayed value
channels once (a tap at lag 1), then both convolutions as per-token graph code over each
token's window, and the position-0 value from ``v_proj_delayed`` of zeros as HF does. Only the
exact class with the forward sources this was derived from (transformers 5.24 and 5.17, which
differ in the cache path only) is taken.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from .hybrid import WINDOW_MODULES, one_hot_taps, window
from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward
from .scope import active_scope

__all__ = ["KNOWN_SOURCES", "zaya_hooks"]

KNOWN_SOURCES = frozenset({"babdc65709b5bb07", "69b47ca6d0c17e57"})
"""sha256 prefixes of ``ZayaCCAProjection.forward`` (transformers 5.24, 5.17)."""

WINDOW_MODULES.add("transformers.models.zaya.modeling_zaya.ZayaCCAProjection")


def _forward(self, hidden_states: torch.Tensor, cache=None, conv_mask=None,
             past_key_values=None):
    """``ZayaCCAProjection.forward`` over capture-owned windows (module docstring)."""
    if cache is not None or past_key_values is not None:
        raise NotImplementedError(f"{type(self).__name__}: called with a cache; the capture "
                                  "runs use_cache=False and owns the conv and value states")
    scope = active_scope()
    if conv_mask is not None:
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    projected_queries = self.q_proj(hidden_states)
    projected_keys = self.k_proj(hidden_states)
    qk_states = torch.cat([projected_queries, projected_keys], dim=-1)  # [bs, T, C]
    query_residual = projected_queries.view(*hidden_shape)
    key_residual = projected_keys.view(*hidden_shape)
    key_residual = key_residual.repeat_interleave(self.num_key_value_groups, dim=2)
    query_residual = (query_residual + key_residual) * 0.5
    key_residual = query_residual.view(*input_shape, -1, self.num_key_value_groups,
                                       self.head_dim).mean(dim=-2)
    value_current = self.v_proj_current(hidden_states)
    delayed = self.v_proj_delayed(hidden_states)  # [bs, T, Cv]

    k = self.conv_kernel_size  # past tokens a query or key channel reads
    channels, delayed_channels = qk_states.shape[-1], delayed.shape[-1]
    device = qk_states.device
    lags = torch.cat([torch.arange(k + 1, device=device).repeat_interleave(channels),
                      torch.ones(delayed_channels, dtype=torch.int64, device=device)])
    x = torch.cat([qk_states.repeat(1, 1, k + 1), delayed.to(qk_states.dtype)], dim=-1)
    width = max(k + 1, 2)
    past = window(x.transpose(1, 2), one_hot_taps(lags, width, x.dtype))  # [bs, (K+1)C+Cv, T]
    past = past.transpose(1, 2)
    # the window oldest first: [bs, T, C, K + 1], lag K at index 0
    qk_window = past[..., : (k + 1) * channels].unflatten(-1, (k + 1, channels))
    qk_window = qk_window.flip(-2).transpose(-1, -2)
    depthwise, grouped = self.conv_qk_depthwise, self.conv_qk_grouped
    k0, k1 = depthwise.kernel_size[0], grouped.kernel_size[0]
    w0 = depthwise.weight.view(channels, k0)
    mixed = sum(qk_window[..., i:i + k1] * w0[:, i, None] for i in range(k0))
    if depthwise.bias is not None:
        mixed = mixed + depthwise.bias[:, None]  # [bs, T, C, k1]
    groups = grouped.groups
    per = channels // groups
    mixed = mixed.unflatten(-2, (groups, per))  # [bs, T, G, per, k1]
    w = grouped.weight.view(groups, per, per, k1)  # [G, out, in, k1]
    qk_out = torch.einsum("...gim,goim->...go", mixed, w).flatten(-2)
    if grouped.bias is not None:
        qk_out = qk_out + grouped.bias
    query_size = query_residual.shape[-2] * query_residual.shape[-1]
    query = qk_out[..., :query_size].view(*hidden_shape) + query_residual
    key = qk_out[..., query_size:].view(*hidden_shape) + key_residual

    before = self.v_proj_delayed(hidden_states.new_zeros(1, 1, self.hidden_size))  # [1, 1, Cv]
    previous = past[..., (k + 1) * channels:].to(delayed.dtype)
    first = (scope.positions == 0)[..., None]  # a request's first token: HF's zeros input
    value_delayed = torch.where(first, before, previous)
    value = torch.cat([value_current, value_delayed], dim=-1).view(*hidden_shape)
    return query, key, value


@contextlib.contextmanager
def zaya_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s CCA projections over capture-owned windows; restored after. A model
    without them is left untouched."""
    classes, found = modeling_instances(model, "transformers.models.zaya.modeling_zaya",
                                        ("ZayaCCAProjection",))
    if not found:
        yield
        return
    ZayaCCAProjection, = classes
    for m in found:
        convs = (m.conv_qk_depthwise, m.conv_qk_grouped)
        plain = all(c.padding == (0,) and c.stride == (1,) and c.dilation == (1,) and
                    c.padding_mode == "zeros" for c in convs) and \
            m.conv_qk_depthwise.groups == m.conv_qk_depthwise.in_channels and \
            m.conv_kernel_size == sum(c.kernel_size[0] - 1 for c in convs) and \
            {p.dtype for p in m.parameters()} <= PLAIN_FLOATS
        if not known_forward(m, ZayaCCAProjection, KNOWN_SOURCES) or not plain:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: ZAYA's CCA projection is "
                "captured from its own forward (transformers 5.24, 5.17) with unpadded, "
                "unstrided convolutions and plain float weights only, and this one reads "
                "otherwise; the model is refused rather than verified wrong")
    with swapped_forward(ZayaCCAProjection, _forward):
        yield
