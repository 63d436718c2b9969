"""RecurrentGemma's (Griffin's) recurrent block: its temporal conv and its RG-LRU, with their
states owned by the capture.

``RecurrentGemmaRecurrentBlock`` runs ``nn.Conv1d`` over the tokens itself and its RG-LRU
(``RecurrentGemmaRglru``) scans them in a Python loop over ``T``, each keeping its state on the
module: a capture can own neither. The RG-LRU is a diagonal linear recurrence, per channel::

    a_t = exp(-8 * r_t * softplus(L))        r_t = sigmoid(W_r x_t + b_r)   (per head blocks)
    h_t = a_t * h_{t-1} + x_t * i_t * sqrt(1 - a_t^2)   (a = 0 and sqrt(...) = 1 at position 0)

While a model is captured, :func:`griffin_hooks` replaces the block's forward with
:func:`_forward`: the conv through ``hybrid.window`` (its weights and bias, a conv layer of the
capture), the gates as the module's own arithmetic (graph code, token-wise), and the recurrence
through ``hybrid.diagonal_scan``, a Mamba-1 scan with one state channel: ``dt = r_t``, ``A =
-8 * softplus(L)`` (so ``exp(dt * A) = a_t``), ``B = C = 1`` and input ``x_t / r_t`` (the scan
multiplies by ``dt``; where ``r_t`` is 0 the input is 0, as HF's ``sqrt(1 - 1)``). A request's
state starts from zeros, which is HF's reset at position 0. Only the exact classes with the
sources this was derived from (transformers 5.24 and 5.17 read the same) are taken.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .hybrid import WINDOW_MODULES, diagonal_scan, window
from .replaced import PLAIN_FLOATS, known_forward, modeling_instances, swapped_forward

__all__ = ["KNOWN_SOURCES", "griffin_hooks"]

KNOWN_SOURCES = {
    ("RecurrentGemmaRecurrentBlock", "forward"): frozenset({"cce3570274ab15aa"}),
    ("RecurrentGemmaRglru", "forward"): frozenset({"b4ad72fdf0d80030"}),
    ("RecurrentGemmaRglru", "_rnn_scan"): frozenset({"edcf0cbffabce491"}),
}
"""sha256 prefixes of the sources this capture was derived from, per (class, method)."""

_MODELING = "transformers.models.recurrent_gemma.modeling_recurrent_gemma"
WINDOW_MODULES.add(f"{_MODELING}.RecurrentGemmaRecurrentBlock")


def _gates(lru: nn.Module, x: torch.Tensor):
    """The RG-LRU's input and recurrence gates of ``x [bs, T, W]``, as its forward computes
    them (a head's block of channels through its own square matrix; its ``baddbmm`` as a
    ``bmm`` plus the bias, ops the token-axis proof knows)."""
    bs, t, width = x.shape
    rows = x.reshape(bs * t, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
    gate = torch.bmm(rows, lru.input_gate_weight) + lru.input_gate_bias[:, None, :]
    input_gate = torch.sigmoid(gate.transpose(0, 1).reshape(bs, t, width))
    gate = torch.bmm(rows, lru.recurrent_gate_weight) + lru.recurrent_gate_bias[:, None, :]
    recurrent_gate = torch.sigmoid(gate.transpose(0, 1).reshape(bs, t, width))
    return input_gate, recurrent_gate


def _rg_lru(lru: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``RecurrentGemmaRglru.forward`` over a capture-owned state (module docstring)."""
    input_gate, r = _gates(lru, x)
    log_a = -8.0 * r * F.softplus(lru.recurrent_param)
    a_square = torch.exp(2 * log_a)
    reset = position_ids[:, :, None] == 0
    multiplier = torch.sqrt(1 - a_square)
    multiplier = reset + ~reset * multiplier
    normalized = (x * input_gate) * multiplier.type(x.dtype)
    inputs = torch.where(r > 0, normalized.float() / r.float(), 0.0)  # the scan multiplies by r
    ones = torch.ones_like(r[..., :1]).transpose(1, 2)  # B = C = 1: [bs, 1, T]
    a = (-8.0 * F.softplus(lru.recurrent_param.float()))[:, None]  # [W, 1]: exp(r * A) = a_t
    h = diagonal_scan(inputs.transpose(1, 2), r.float().transpose(1, 2), a, ones.float(),
                      ones.float())
    return h.transpose(1, 2).to(x.dtype)


def _forward(self, input_states: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
             use_cache: bool = True, **kwargs):
    """``RecurrentGemmaRecurrentBlock.forward`` over capture-owned states."""
    seq_len = input_states.shape[1]
    y_branch = self.act_fn(self.linear_y(input_states))
    x_branch = self.linear_x(input_states).transpose(1, 2)  # [bs, W, T]
    x_branch = window(x_branch, self.conv_1d.weight[:, 0, :], self.conv_1d.bias)[..., :seq_len]
    x_branch = _rg_lru(self.rg_lru, x_branch.transpose(1, 2), position_ids)
    return self.linear_out(x_branch * y_branch), None


@contextlib.contextmanager
def griffin_hooks(model: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Run ``model``'s RecurrentGemma recurrent blocks over capture-owned states; restored
    after. A model without them is left untouched."""
    classes, found = modeling_instances(
        model, "transformers.models.recurrent_gemma.modeling_recurrent_gemma",
        ("RecurrentGemmaRecurrentBlock", "RecurrentGemmaRglru"))
    if not found:
        yield
        return
    RecurrentGemmaRecurrentBlock, RecurrentGemmaRglru = classes
    for m in found:
        conv = m.conv_1d
        known = known_forward(m, RecurrentGemmaRecurrentBlock,
                              KNOWN_SOURCES[("RecurrentGemmaRecurrentBlock", "forward")]) and \
            all(known_forward(m.rg_lru, RecurrentGemmaRglru, KNOWN_SOURCES[key], key[1])
                for key in KNOWN_SOURCES if key[0] == "RecurrentGemmaRglru") and \
            conv.groups == conv.in_channels == conv.out_channels and conv.stride == (1,) and \
            conv.dilation == (1,) and conv.padding == (conv.kernel_size[0] - 1,) and \
            conv.kernel_size[0] >= 2 and {p.dtype for p in m.parameters()} <= PLAIN_FLOATS
        if not known:
            raise NotImplementedError(
                f"{type(m).__name__} {names.get(id(m), '?')!r}: RecurrentGemma's recurrent "
                "block is captured from its own and its RG-LRU's sources (transformers 5.24, "
                "5.17) with a causal depthwise conv and plain float weights only, and this one "
                "reads otherwise; the model is refused rather than verified wrong")
    with swapped_forward(RecurrentGemmaRecurrentBlock, _forward):
        yield
