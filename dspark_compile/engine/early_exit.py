"""Self-draft by early exit: the target's first ``k`` layers, its final norm and its head.

:func:`early_exit_model` builds that draft model as a model of the target's own class (an HF
causal LM) that *shares* the target's embedding, first ``k`` decoder layers, norm, rotary
embedding and head: no weights are copied or trained. Being an ordinary HF model it also serves
as ``assistant_model=`` of transformers' ``generate``.

:class:`EarlyExitDrafter` drafts greedily with it, ``gamma`` tokens per request, keeping one KV
cache per request across steps (cropped to the prefix the request kept, so a step feeds only
the tokens emitted since the last one). Its confidence is a real confidence head: the draft
model's probability of its own token (``q_max``), calibrated online by the runtime (the
acceptance estimator's logistic fit by default, or the temperature calibrator) from the
outcomes :class:`DraftTracker` reads off the next call's sequences.

Drafting a request stops early once the survival of its drafts (the product of their calibrated
confidences) falls below ``stop_below``: the planner would not verify them, so the draft model
need not run them. The positions left get the last token again and confidence 0.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..runtime import (AcceptanceEstimator, CalibrationConfig, EstimatorConfig,
                       TemperatureCalibrator)
from .drafter import Drafts
from .outcomes import DraftTracker, as_numpy

__all__ = ["early_exit_model", "EarlyExitDrafter", "CONFIDENCE"]

_PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types", "sliding_window_pattern_list")


def early_exit_model(target: nn.Module, layers: int) -> nn.Module:
    """A model of ``type(target)`` over the target's first ``layers`` decoder layers, sharing
    every tensor with the target (HF decoder layout: ``target.model.layers``, the rest of
    ``target.model``'s children and ``target.lm_head``). In ``eval()`` mode."""
    inner = getattr(target, "model", None)
    stack = getattr(inner, "layers", None)
    config = getattr(target, "config", None)
    if not isinstance(stack, nn.ModuleList) or config is None or \
            not hasattr(target, "lm_head"):
        raise ValueError(f"early_exit_model: {type(target).__name__} is not an HF decoder with "
                         ".model.layers (a ModuleList), .lm_head and .config; build the draft "
                         "model by hand")
    if not (isinstance(layers, int) and 1 <= layers < len(stack)):
        raise ValueError(f"early_exit_model: layers={layers!r}; it must be an int in "
                         f"1..{len(stack) - 1} (the target has {len(stack)})")
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    for name in _PER_LAYER_FIELDS:
        value = getattr(cfg, name, None)
        if isinstance(value, (list, tuple)) and len(value) == len(stack):
            setattr(cfg, name, type(value)(value[:layers]))
    with torch.device("meta"):
        draft = type(target)(cfg)
    for name, child in list(draft.model.named_children()):
        if name == "layers":
            draft.model.layers = nn.ModuleList(stack[:layers])
        else:
            setattr(draft.model, name, getattr(inner, name))
    draft.lm_head = target.lm_head
    left = [n for n, t in (*draft.named_parameters(), *draft.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"early_exit_model: {type(target).__name__}'s draft still has tensors "
                         f"of its own ({left[:3]}); only shared submodules are supported")
    if hasattr(target, "generation_config"):
        draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


CONFIDENCE = ("logistic", "temperature", "raw")


class _ConfidenceHead:
    """Maps the draft model's ``q_max`` to the planner's conditional acceptance, learning from
    outcomes: ``"logistic"``, the runtime's AcceptanceEstimator on ``logit(q_max)`` (slope 1,
    intercepts 0 to start: the identity); ``"temperature"``, its TemperatureCalibrator; ``"raw"``,
    ``q_max`` as it is."""

    def __init__(self, kind: str, gamma: int, prior_trials: float, refit_every: int) -> None:
        self.kind, self.gamma = kind, gamma
        if kind == "logistic":
            self.fit = AcceptanceEstimator(EstimatorConfig(gamma=gamma, refit_every=refit_every,
                                                           damping=8.0))
        elif kind == "temperature":
            self.fit = TemperatureCalibrator(CalibrationConfig(gamma=gamma,
                                                               prior_trials=prior_trials))
        else:
            self.fit = None

    @staticmethod
    def _x(q: torch.Tensor) -> torch.Tensor:
        return torch.logit(q.double().clamp(1e-12, 1 - 1e-12)).clamp(-40.0, 40.0)

    def one(self, q: float, j: int) -> float:
        """The mapped confidence of ``q`` at draft position ``j``."""
        if self.kind == "raw":
            return q
        if self.kind == "logistic":
            x = self._x(torch.tensor(q))
            return float(torch.sigmoid(self.fit.slope * x + self.fit.bias[j]))
        z = self._x(torch.tensor(q)).clamp(-self.fit.config.logit_range,
                                           self.fit.config.logit_range)
        return float(torch.sigmoid(z / self.fit.temperatures()[j]))

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        if self.kind == "raw":
            return raw.clone()
        if self.kind == "logistic":
            return self.fit.predict(self._x(raw))
        return self.fit.calibrate(raw)

    def observe(self, raw: torch.Tensor, accepted: torch.Tensor, verified: torch.Tensor) -> None:
        if self.kind == "logistic":
            self.fit.observe(self._x(raw), accepted, verified)
        elif self.kind == "temperature":
            self.fit.observe(raw, accepted, verified)


class EarlyExitDrafter:
    """``Drafter`` from the target's first ``layers`` layers (see the module docstring).

    ``confidence``: how ``q_max`` becomes the planner's confidence, one of ``CONFIDENCE``:
    ``"logistic"`` (default) fits ``sigmoid(slope * logit(q_max) + bias_k)`` online, which can
    also pull an overconfident head *below* 1/2 (an untrained early exit is one: on SmolLM2 its
    ``q_max`` runs far above its hit rate); ``"temperature"`` scales ``logit(q_max)`` per
    position, which only moves it toward 1/2; ``"raw"`` trusts ``q_max``. ``refit_every`` (and a
    damping of 8 labelled drafts, not the estimator's default 50) and ``prior_trials`` set how
    fast each learns: a demo's run is a few dozen steps."""

    def __init__(self, target: nn.Module, layers: int, confidence: str = "logistic",
                 stop_below: float = 0.02, refit_every: int = 2,
                 prior_trials: float = 16.0) -> None:
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"EarlyExitDrafter: stop_below={stop_below!r}; it must be in [0, 1)")
        if confidence not in CONFIDENCE:
            raise ValueError(f"EarlyExitDrafter: confidence={confidence!r}; it must be one of "
                             f"{CONFIDENCE}")
        self.model = early_exit_model(target, layers)
        self.layers = layers
        self.confidence, self.stop_below = confidence, stop_below
        self.refit_every, self.prior_trials = refit_every, prior_trials
        self.head: _ConfidenceHead | None = None
        self.tracker = DraftTracker()
        self._caches: dict[bytes, tuple[np.ndarray, object]] = {}
        self.judged = 0
        """Drafts whose outcome the tracker has seen (right or the first wrong one)."""
        self.right = 0
        """Of those, the ones that were right."""
        self.forward_tokens = 0
        """Tokens the draft model ran (its cost)."""

    def _head(self, gamma: int) -> _ConfidenceHead:
        if self.head is None or self.head.gamma != gamma:
            self.head = _ConfidenceHead(self.confidence, gamma, self.prior_trials,
                                        self.refit_every)
        return self.head

    @torch.no_grad()
    def draft(self, sequences: Sequence[torch.Tensor], gamma: int) -> Drafts:
        seqs = as_numpy(sequences)
        head = self._head(gamma)
        outcomes = self.tracker.outcomes(seqs, gamma)
        if outcomes:
            raw = torch.stack([o.payload for o in outcomes])
            acc = torch.tensor([o.accepted for o in outcomes])
            ver = torch.tensor([o.verified for o in outcomes])
            head.observe(raw, acc, ver)
            self.judged += int(ver.sum())
            self.right += int(acc.sum())
        r = len(seqs)
        tokens = np.zeros((r, gamma), dtype=np.int64)
        raw = torch.zeros(r, gamma, dtype=torch.float32)
        valid = np.zeros(r, dtype=np.int64)
        caches = {}
        for i, seq in enumerate(seqs):
            cache = self._cache_for(seq)
            toks, q, n = self._draft_one(seq, cache, gamma, head)
            tokens[i], raw[i], valid[i] = toks, q, n
            fed = np.concatenate([seq, toks[:n - 1]])  # what the cache holds now
            caches[fed.tobytes()] = (fed, cache)
        self._caches = caches  # requests not seen this step are gone
        self.tracker.remember(seqs, tokens, valid, list(raw))
        confidence = head(raw)
        confidence[torch.arange(gamma)[None, :] >= torch.from_numpy(valid)[:, None]] = 0.0
        return Drafts(torch.from_numpy(tokens), confidence)

    def _cache_for(self, seq: np.ndarray):
        """The cache whose tokens share the longest prefix with ``seq``, cropped to it (a fresh
        one when none shares any)."""
        from transformers import DynamicCache

        best, best_len = None, 0
        for key, (toks, cache) in self._caches.items():
            n = min(len(toks), len(seq))
            differ = np.flatnonzero(toks[:n] != seq[:n])
            lcp = int(differ[0]) if differ.size else n
            if lcp > best_len:
                best, best_len = key, lcp
        if best is None:
            return DynamicCache(config=self.model.config)
        toks, cache = self._caches.pop(best)
        keep = min(best_len, len(seq) - 1)  # the last token is fed again for its logits
        cache.crop(keep - cache.get_seq_length())
        return cache

    def _draft_one(self, seq: np.ndarray, cache, gamma: int, head: _ConfidenceHead):
        """``(tokens [gamma], raw q_max [gamma], drafted)``; ``drafted`` <= gamma are real."""
        dev = next(self.model.parameters()).device
        feed = torch.from_numpy(seq[cache.get_seq_length():]).to(dev)[None]
        toks = np.zeros(gamma, dtype=np.int64)
        q = torch.zeros(gamma)
        survival, n = 1.0, 0
        while n < gamma and (n == 0 or survival >= self.stop_below):
            self.forward_tokens += feed.shape[1]
            logits = self.model(input_ids=feed, cache=cache, use_cache=True,
                                logits_to_keep=1).logits[0, -1].float()
            p, tok = torch.softmax(logits, dim=-1).max(dim=-1)
            toks[n], q[n] = int(tok), float(p)
            survival *= head.one(float(p), n)
            feed = tok.view(1, 1).to(dev)
            n += 1
        toks[n:] = toks[n - 1]
        return toks, q, n

    def acceptance(self) -> float:
        """Right / judged drafts so far (nan before any was judged)."""
        return self.right / self.judged if self.judged else float("nan")
