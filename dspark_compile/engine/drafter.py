"""Drafters for the reference engine.

``NoisyCopyDrafter`` is self-speculation with a controllable acceptance: a copy of the target
whose weights carry Gaussian noise (``noise`` times each tensor's own standard deviation).
Noise 0 drafts exactly what the target would emit (every greedy draft accepted); larger noise
lowers acceptance smoothly. It drafts greedily by running the copy's own forward over each
request's whole sequence: a correctness reference, not a fast drafter.

``SyntheticDrafter`` costs a table lookup, for benchmarks of the verify side: it knows each
request's greedy continuation (decoded beforehand with no speculation) and proposes its next
tokens, each right with a probability drawn per draft, which it reports as its confidence
(calibrated by construction). It is indexed by request and emitted count, the way a batch
engine holds its state, not by sequences (it is not a ``Drafter``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["Drafts", "Drafter", "NoisyCopyDrafter", "SyntheticDrafter", "per_draft_acceptance"]


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


def per_draft_acceptance(mean_accepted: float, gamma: int) -> float:
    """``mu`` with ``sum_{j=1..gamma} mu^j = mean_accepted``: the per-draft acceptance that gives
    that mean number of accepted drafts per step when drafts are accepted independently."""
    if not (isinstance(gamma, int) and gamma >= 1 and 0 < mean_accepted < gamma):
        raise ValueError(f"per_draft_acceptance: mean_accepted={mean_accepted}, gamma={gamma}; "
                         "gamma must be an int >= 1 and the mean in (0, gamma) drafts per step")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the sum increases with mu: bisection to float precision
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, gamma + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticDrafter:
    """Calibrated synthetic drafts over known greedy continuations (see the module docstring).

    ``reference [R, L]`` int64: request ``r``'s greedy tokens, ``reference[r, e]`` the ``e``-th
    emitted (the prefill's token at 0). With ``e`` tokens emitted, draft ``j`` is meant to be
    ``reference[r, e + j]``. Per ``(r, e, j)``, seeded: confidence ``c ~ Beta(mu * k, (1 - mu) *
    k)`` with ``k = concentration`` and ``mu = per_draft_acceptance(mean_accepted, gamma)``; the
    draft is right with probability ``c`` and otherwise ``(right + 1) % vocab``. A target whose
    greedy tokens are ``reference`` then accepts ``mean_accepted`` drafts per full block on
    average, and the confidences are the true conditional acceptance probabilities.
    """

    def __init__(self, reference: np.ndarray, gamma: int, mean_accepted: float,
                 concentration: float, vocab: int, seed: int) -> None:
        reference = np.asarray(reference)
        if reference.ndim != 2 or reference.dtype != np.int64 or reference.shape[1] <= gamma:
            raise ValueError(f"SyntheticDrafter: reference has shape {reference.shape} and dtype "
                             f"{reference.dtype}; it must be int64 [R, L] with L > gamma={gamma}")
        if not concentration > 0:
            raise ValueError(f"SyntheticDrafter: concentration={concentration}; alpha + beta of "
                             "the confidence Beta must be > 0 (2.0 is a spread-out signal)")
        self.mu = per_draft_acceptance(mean_accepted, gamma)
        requests, length = reference.shape
        rng = np.random.default_rng(seed)
        shape = (requests, length, gamma)
        self.confidence = rng.beta(self.mu * concentration, (1 - self.mu) * concentration,
                                   size=shape).astype(np.float32)  # [R, L, gamma]
        right = rng.random(shape) < self.confidence  # [R, L, gamma]
        at = np.minimum(np.arange(length)[:, None] + np.arange(gamma), length - 1)  # [L, gamma]
        truth = reference[:, at]  # [R, L, gamma]: reference token e + j
        self.tokens = np.where(right, truth, (truth + 1) % vocab)  # wrong ones never match
        self.max_count = length - gamma  # the largest count whose drafts are all in reference

    def draft(self, rids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """int64 drafts and float32 confidences ``[len(rids), gamma]`` of requests ``rids``
        that have emitted ``counts`` tokens (NumPy; no Python loop over requests)."""
        if counts.size and (counts.min() < 1 or counts.max() > self.max_count):
            raise ValueError(f"SyntheticDrafter.draft: counts span {counts.min()}.."
                             f"{counts.max()}; they must be in 1..{self.max_count} (decode a "
                             "longer reference)")
        return self.tokens[rids, counts], self.confidence[rids, counts]
