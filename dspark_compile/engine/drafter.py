"""Drafters for the reference engine.

``NoisyCopyDrafter`` is self-speculation with a controllable acceptance: a copy of the target
whose weights carry Gaussian noise (``noise`` times each tensor's own standard deviation).
Noise 0 drafts exactly what the target would emit (every greedy draft accepted); larger noise
lowers acceptance smoothly. It drafts greedily by running the copy's own forward over each
request's whole sequence: a correctness reference, not a fast drafter.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn

__all__ = ["Drafts", "Drafter", "NoisyCopyDrafter"]


@dataclass(frozen=True)
class Drafts:
    """``gamma`` draft tokens per request and the drafter's confidence in each."""

    tokens: torch.Tensor
    """int64 [R, gamma]."""
    confidence: torch.Tensor
    """float32 [R, gamma] in [0, 1]: the drafter's probability of its own token (q_max)."""


class Drafter(Protocol):
    def draft(self, sequences: Sequence[torch.Tensor], gamma: int) -> Drafts:
        """Draft ``gamma`` tokens after each sequence (prompt + emitted, the anchor last)."""


def _logits(model: nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """Last-row logits of ``model`` over ``seq`` (HF causal LM or a plain decoder)."""
    with torch.no_grad():
        if hasattr(model, "config"):
            return model(seq[None]).logits[0, -1]
        positions = torch.arange(seq.numel(), device=seq.device)[None]
        return model(seq[None], positions)[0, -1]


class NoisyCopyDrafter:
    """Greedy drafts from a noisy copy of the target (see the module docstring)."""

    def __init__(self, target: nn.Module, noise: float, seed: int = 0) -> None:
        if noise < 0:
            raise ValueError(f"NoisyCopyDrafter: noise={noise}; it must be >= 0")
        self.model = copy.deepcopy(target).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point() and p.numel() > 1:
                    scale = noise * p.float().std().item()
                    p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))

    def draft(self, sequences: Sequence[torch.Tensor], gamma: int) -> Drafts:
        tokens = torch.zeros(len(sequences), gamma, dtype=torch.int64)
        confidence = torch.zeros(len(sequences), gamma, dtype=torch.float32)
        for i, seq in enumerate(sequences):
            seq = seq.clone()
            for j in range(gamma):
                probs = torch.softmax(_logits(self.model, seq).float(), dim=-1)
                q, tok = probs.max(dim=-1)
                tokens[i, j], confidence[i, j] = tok.item(), q.item()
                seq = torch.cat([seq, tok.view(1).to(seq.device)])
        return Drafts(tokens, confidence)
