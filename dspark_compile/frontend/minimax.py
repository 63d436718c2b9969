"""MiniMax's lightning attention captured as a Mamba-2-form scan (``dspark::ssd``, no conv).

``MiniMaxLightningAttention`` mixes tokens through a linear attention with one decay a head,
``lambda_h = exp(-slope_h)``: per token, from the layer's ``[d, d]`` state ``S`` of each head,
``S <- lambda_h S + k (x) v`` and ``out = q S``. Its forward computes that in blocks of
``block_size`` tokens, looping over ``cdiv(T, block_size)`` blocks, which a capture cannot hold
(the token count is symbolic). That is exactly ``dspark::ssd`` with ``x = v``, ``dt = 1``,
``A = -slope``, ``B = k``, ``C = q`` (one group a head, no ``D``, no softplus, no clamp):
``S <- S * exp(A * dt) + B (x) (x * dt)``, ``out = S^T C``. While a model is captured,
:func:`lightning_hooks` replaces the class's forward with :func:`_forward`, which keeps the
module's own token-wise code (the activated qkv projection, the norm, the sigmoid output gate
and the output projection) and routes the scan through the capture scope, so each layer gets a
state pool and a replay ring like a Mamba-2 mixer, with no conv window (``LinearSpec.kind``
``"scan"``).

Only the exact class with a forward whose source this was derived from (transformers 5.17 or
5.24) is taken; a subclass or a changed forward is refused naming the module. The capture runs
with ``use_cache=False`` and no padding mask; a forward given either is refused.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from .replaced import known_forward, swapped_forward
from .recurrent import RecurrentLayers

__all__ = ["KNOWN_SOURCES", "has_lightning", "lightning_hooks"]

KNOWN_SOURCES = frozenset({"03c3f915c0c99c09", "693a8e8a3970703e"})
"""sha256 prefixes of ``MiniMaxLightningAttention.forward`` this capture was derived from:
transformers 5.24 and 5.17 (which names the cache argument ``past_key_values`` and builds the
zero state with ``.to(value_states)``; the same arithmetic)."""
FUNCTION = "MiniMaxLightningAttention.forward"


def _forward(layers: RecurrentLayers, module, hidden_states, position_embeddings=None,
             attention_mask=None, cache=None, **kwargs):
    """The lightning layer with its scan through the capture: ``(out [bs, T, hidden], None)``."""
    site = layers.site(FUNCTION)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)  # 5.17's name
    if cache is not None or attention_mask is not None:
        raise NotImplementedError(
            f"{site.where} was given a {'cache' if cache is not None else 'padding mask'}; "
            "the capture runs the model with use_cache=False and no padding (the layout "
            "carries the requests), so this call is refused")
    bs, t, _ = hidden_states.shape
    heads, dim = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states)).reshape(bs, t, heads, 3 * dim)
    query, key, value = torch.split(qkv, dim, dim=3)  # [bs, T, H, d] each
    if site.discovering:
        layers.record(site, "scan", (heads, dim, dim))
        out = value.new_zeros(value.shape, dtype=torch.float32)
    else:
        decay = -module.slope_rate.reshape(heads).to(torch.float32)  # log lambda_h
        ones = torch.ones_like(value[..., 0])  # dt = 1: x * dt = v, A * dt = -slope
        out = site.scope.ssd(site.layer, value, ones, decay, key, query, None, None, False,
                             0.0, math.inf)
    out = out.to(value.dtype).reshape(bs, t, heads * dim)
    out = module.norm(out)
    out = F.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None


def _lightning_class():
    try:
        from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention
    except ImportError:  # a transformers without MiniMax
        return None
    return MiniMaxLightningAttention


def has_lightning(model) -> bool:
    """``model`` holds a MiniMax lightning attention layer."""
    cls = _lightning_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


@contextlib.contextmanager
def lightning_hooks(layers: RecurrentLayers) -> Iterator[None]:
    """Route every MiniMax lightning layer of ``layers.model`` through :func:`_forward` for the
    capture (see the module docstring); the class's forward is restored after."""
    MiniMaxLightningAttention = _lightning_class()
    found = [] if MiniMaxLightningAttention is None else \
        [m for m in layers.model.modules() if isinstance(m, MiniMaxLightningAttention)]
    if not found:
        yield
        return
    for m in found:
        if not known_forward(m, MiniMaxLightningAttention, KNOWN_SOURCES):
            raise NotImplementedError(
                f"{layers.name(m)}: its lightning attention is captured from "
                "MiniMaxLightningAttention's own forward (transformers 5.17 and 5.24) only, and "
                "this forward reads otherwise; the model is refused rather than verified wrong")

    def forward(module, *args, **kwargs):
        return _forward(layers, module, *args, **kwargs)

    with swapped_forward(MiniMaxLightningAttention, forward):
        yield
