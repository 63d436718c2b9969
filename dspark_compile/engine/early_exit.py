"""Self-draft by early exit: the target's first ``k`` layers, its final norm and its head.

:func:`early_exit_model` builds that draft model as a model of the target's own class (an HF
causal LM) that *shares* the target's embedding, first ``k`` decoder layers, norm, rotary
embedding and head: no weights are copied or trained. Being an ordinary HF model it also serves
as ``assistant_model=`` of transformers' ``generate``.

:class:`EarlyExitDrafter` drafts greedily with it, ``gamma`` tokens per request, keeping one KV
cache per request across steps (cropped to the prefix the request kept, so a step feeds only
the tokens emitted since the last one). Its confidence is a real confidence head: the draft
model's probability of its own token (``q_max``), temperature-calibrated online by the
runtime's :class:`TemperatureCalibrator` from the outcomes :class:`DraftTracker` reads off the
next call's sequences (``calibrate=False``: raw ``q_max``; ``prior_trials``: how many judged
drafts a position needs before its own temperature weighs as much as the pooled one, fewer than
the calibrator's default 64 so that a short run adapts).

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

from ..runtime import CalibrationConfig, TemperatureCalibrator
from .drafter import Drafts
from .outcomes import DraftTracker, as_numpy

__all__ = ["early_exit_model", "EarlyExitDrafter"]

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


class EarlyExitDrafter:
    """``Drafter`` from the target's first ``layers`` layers (see the module docstring)."""

    def __init__(self, target: nn.Module, layers: int, calibrate: bool = True,
                 stop_below: float = 0.02, prior_trials: float = 16.0) -> None:
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"EarlyExitDrafter: stop_below={stop_below!r}; it must be in [0, 1)")
        self.model = early_exit_model(target, layers)
        self.layers = layers
        self.calibrate, self.stop_below, self.prior_trials = calibrate, stop_below, prior_trials
        self.calibrator: TemperatureCalibrator | None = None
        self.tracker = DraftTracker()
        self._caches: dict[bytes, tuple[np.ndarray, object]] = {}
        self.judged = 0
        """Drafts whose outcome the tracker has seen (right or the first wrong one)."""
        self.right = 0
        """Of those, the ones that were right."""
        self.forward_tokens = 0
        """Tokens the draft model ran (its cost)."""

    def _calibrator(self, gamma: int) -> TemperatureCalibrator:
        if self.calibrator is None or self.calibrator.config.gamma != gamma:
            self.calibrator = TemperatureCalibrator(CalibrationConfig(
                gamma=gamma, prior_trials=self.prior_trials))
        return self.calibrator

    @torch.no_grad()
    def draft(self, sequences: Sequence[torch.Tensor], gamma: int) -> Drafts:
        seqs = as_numpy(sequences)
        cal = self._calibrator(gamma)
        outcomes = self.tracker.outcomes(seqs, gamma)
        if outcomes:
            raw = torch.stack([o.payload for o in outcomes])
            acc = torch.tensor([o.accepted for o in outcomes])
            ver = torch.tensor([o.verified for o in outcomes])
            cal.observe(raw, acc, ver)
            self.judged += int(ver.sum())
            self.right += int(acc.sum())
        r = len(seqs)
        tokens = np.zeros((r, gamma), dtype=np.int64)
        raw = torch.zeros(r, gamma, dtype=torch.float32)
        valid = np.zeros(r, dtype=np.int64)
        temps = cal.temperatures().float() if self.calibrate else torch.ones(gamma)
        caches = {}
        for i, seq in enumerate(seqs):
            cache = self._cache_for(seq)
            toks, q, n = self._draft_one(seq, cache, gamma, temps)
            tokens[i], raw[i], valid[i] = toks, q, n
            fed = np.concatenate([seq, toks[:n - 1]])  # what the cache holds now
            caches[fed.tobytes()] = (fed, cache)
        self._caches = caches  # requests not seen this step are gone
        self.tracker.remember(seqs, tokens, valid, list(raw))
        confidence = cal.calibrate(raw) if self.calibrate else raw.clone()
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

    def _draft_one(self, seq: np.ndarray, cache, gamma: int, temps: torch.Tensor):
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
            survival *= float(torch.sigmoid(torch.logit(p.clamp(1e-6, 1 - 1e-6)) / temps[n]))
            feed = tok.view(1, 1).to(dev)
            n += 1
        toks[n:] = toks[n - 1]
        return toks, q, n

    def acceptance(self) -> float:
        """Right / judged drafts so far (nan before any was judged)."""
        return self.right / self.judged if self.judged else float("nan")
