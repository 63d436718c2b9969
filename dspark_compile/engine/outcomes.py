"""What became of a drafter's last drafts, read off the sequences it is given next.

A ``Drafter`` sees only sequences (prompt + emitted tokens, the anchor last), no request ids and
no verify results. That is enough to learn from verification, so that a drafter can fit its
confidence online with no change to the engine or to an external loop that drives it:

- a request's new sequence extends the sequence it was drafted for by ``e`` tokens: the
  ``a = e - 1`` accepted drafts and the token the target emitted after them (the *bonus*);
- under greedy acceptance the bonus is the target's own choice at draft position ``a``, so
  draft ``a`` was right exactly when it equals the bonus, whether or not it was verified (a
  planner may have cut it). Drafts after it were never judged.

:class:`DraftTracker` remembers each step's drafts keyed by the sequence they follow, finds the
entry that a new sequence extends (the longest such prefix), and reports
``(accepted, verified)`` in the convention of the runtime's estimator and calibrator: drafts
``k < accepted`` right, draft ``accepted`` wrong when ``accepted < verified``. A sequence that
extends none (a new request), grew by more than a block, or whose emitted tokens are not its
drafts' prefix (sampling, another drafter) yields no outcome. With sampling acceptance the
labels are approximate (the bonus is a sample, not the target's argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["DraftTracker", "Outcome"]


@dataclass(frozen=True)
class Outcome:
    """The outcome of one request's last drafts."""

    row: int
    """Index of the request in the current ``draft`` call."""
    accepted: int
    """Leading drafts that were right (the target emitted them, or the bonus equals the next)."""
    verified: int
    """Drafts judged: ``accepted + 1`` when draft ``accepted`` was wrong, else ``accepted``."""
    payload: object
    """What the drafter stored with those drafts (its features or raw confidence)."""


class DraftTracker:
    """Drafts remembered by the sequence they follow (see the module docstring)."""

    def __init__(self) -> None:
        self._last: dict[bytes, tuple[int, np.ndarray, np.ndarray, object]] = {}

    def outcomes(self, sequences: Sequence[np.ndarray], gamma: int) -> list[Outcome]:
        """The outcome of each sequence's previous drafts, for the sequences that have one."""
        out = []
        for i, seq in enumerate(sequences):
            for grew in range(1, gamma + 2):  # e = a + 1 emitted, a in 0..gamma
                base = len(seq) - grew
                if base < 1:
                    break
                hit = self._last.get(seq[:base].tobytes())
                if hit is None or hit[0] != base:
                    continue
                _, drafts, valid, payload = hit
                a = grew - 1
                if a > int(valid) or not np.array_equal(seq[base:base + a], drafts[:a]):
                    break  # not drafts of ours that were accepted: learn nothing
                right_next = a < int(valid) and seq[base + a] == drafts[a]
                acc = a + int(right_next)
                ver = min(acc + 1, int(valid)) if not right_next else acc
                out.append(Outcome(i, acc, ver, payload))
                break
        return out

    def remember(self, sequences: Sequence[np.ndarray], drafts: np.ndarray,
                 valid: np.ndarray, payloads: Sequence[object]) -> None:
        """Keep this step's drafts ``[R, gamma]``; ``valid[r]`` of them are real proposals (the
        rest padding, never labelled). Forgets the previous step's."""
        self._last = {seq.tobytes(): (len(seq), drafts[i], valid[i], payloads[i])
                      for i, seq in enumerate(sequences)}


def as_numpy(sequences: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """int64 host arrays of the sequences."""
    return [np.ascontiguousarray(s.detach().cpu().numpy().astype(np.int64, copy=False))
            for s in sequences]
