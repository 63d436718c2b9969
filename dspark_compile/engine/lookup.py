"""Prompt lookup (n-gram) drafting: the model-free drafter serving engines ship.

For each request, the last ``n`` tokens of its sequence (prompt + emitted) are looked up earlier
in the same sequence, trying ``n = max_ngram`` down to ``min_ngram``; the most recent earlier
occurrence wins and the tokens that followed it are the drafts (as many as the sequence holds,
up to ``gamma``). Text that repeats its context (code edits, quotes, lists, chat templates,
answers that restate the question) drafts itself for free.

Confidence comes from the runtime's online :class:`AcceptanceEstimator`: the feature of every
draft of a request is the length ``n`` of the n-gram that matched (one shared slope, one
intercept per draft position), starting at ``sigmoid(n - 2)`` (0.27 / 0.5 / 0.73 for n = 1 / 2
/ 3) and refitted by IRLS from what verification showed (:class:`DraftTracker` reads the
outcomes off the next call's sequences). A request with no match, and the positions past the
end of a short continuation, get confidence 0: the planner verifies only what is worth it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..runtime import AcceptanceEstimator, EstimatorConfig
from .drafter import Drafts
from .outcomes import DraftTracker, as_numpy

__all__ = ["PromptLookupDrafter", "find_continuation"]


def find_continuation(seq: np.ndarray, gamma: int, max_ngram: int = 3,
                      min_ngram: int = 1) -> tuple[np.ndarray, int]:
    """``(tokens, n)``: up to ``gamma`` tokens that followed the most recent earlier occurrence
    of the last ``n`` tokens of ``seq`` (the longest ``n`` in ``max_ngram..min_ngram`` that
    occurs), or an empty array and 0 when none does."""
    length = len(seq)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = seq[length - n:]
        # windows starting at 0..length-n-1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(seq[:length - 1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size:
            begin = int(starts[-1]) + n
            return seq[begin:begin + gamma], n
    return seq[:0], 0


class PromptLookupDrafter:
    """``Drafter`` by prompt lookup, confidence from the online estimator (module docstring).

    ``refit_every``: verify steps between the estimator's Newton steps (few: a demo's run is
    short). ``acceptance()`` reports the drafts it proposed and saw judged so far."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, refit_every: int = 4,
                 estimator: AcceptanceEstimator | None = None) -> None:
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int)
                and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"PromptLookupDrafter: ngram sizes {min_ngram}..{max_ngram}; they "
                             "must be ints with 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.refit_every = max_ngram, min_ngram, refit_every
        self.estimator = estimator
        self.tracker = DraftTracker()
        self.judged = 0
        """Drafts whose outcome the tracker has seen (right or the first wrong one)."""
        self.right = 0
        """Of those, the ones that were right."""

    def _estimator(self, gamma: int) -> AcceptanceEstimator:
        if self.estimator is None or self.estimator.config.gamma != gamma:
            self.estimator = AcceptanceEstimator(EstimatorConfig(
                gamma=gamma, initial_slope=1.0, initial_bias=-2.0,
                refit_every=self.refit_every))
        return self.estimator

    def draft(self, sequences: Sequence[torch.Tensor], gamma: int) -> Drafts:
        seqs = as_numpy(sequences)
        est = self._estimator(gamma)
        self._learn(seqs, gamma, est)
        r = len(seqs)
        tokens = np.zeros((r, gamma), dtype=np.int64)
        valid = np.zeros(r, dtype=np.int64)
        feature = np.zeros((r, gamma), dtype=np.float64)
        for i, seq in enumerate(seqs):
            cont, n = find_continuation(seq, gamma, self.max_ngram, self.min_ngram)
            k = len(cont)
            tokens[i, :k] = cont
            tokens[i, k:] = cont[-1] if k else seq[-1]  # padding, confidence 0
            valid[i], feature[i] = k, float(n)
        x = torch.from_numpy(feature)
        confidence = est.predict(x)  # [R, gamma] float32
        confidence[torch.arange(gamma)[None, :] >= torch.from_numpy(valid)[:, None]] = 0.0
        self.tracker.remember(seqs, tokens, valid, list(feature))
        return Drafts(torch.from_numpy(tokens), confidence)

    def _learn(self, seqs: list[np.ndarray], gamma: int, est: AcceptanceEstimator) -> None:
        outcomes = [o for o in self.tracker.outcomes(seqs, gamma) if o.payload[0] > 0]
        if not outcomes:
            return
        x = torch.tensor(np.stack([o.payload for o in outcomes]))
        acc = torch.tensor([o.accepted for o in outcomes])
        ver = torch.tensor([o.verified for o in outcomes])
        est.observe(x, acc, ver)
        self.judged += int(ver.sum())
        self.right += int(acc.sum())

    def acceptance(self) -> float:
        """Right / judged drafts so far (nan before any was judged)."""
        return self.right / self.judged if self.judged else float("nan")
