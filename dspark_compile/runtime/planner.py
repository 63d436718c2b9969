"""DSpark planner (host reference): how many tokens each request verifies this step.

Input is the draft's conditional confidence ``c [R, gamma]``: ``c[r, j]`` is the probability that
draft ``j`` of request ``r`` is accepted given that drafts ``0..j-1`` were. The survival
``s[r, j] = prod_{m <= j} c[r, m]`` is the probability that draft ``j`` is accepted at all, so
verifying it adds ``s[r, j]`` expected tokens.

Budget: rank the candidates (survivals >= ``min_survival``) in descending order, let ``P_k`` be
the sum of the top ``k`` and pick ``K = argmax_k (R + P_k) * SPS(R + k)`` (expected tokens per
step times steps per second = expected tokens per second), ties to the smallest ``k``.

Lengths: the global top-``K`` survivals, ordered by (survival desc, position asc, request asc);
``len_r = 1 + picks in row r``. Survival never increases along a row and ties go to the lower
position, so the picks of a row are a prefix and the lengths are a valid verify layout.

The host reference runs on NumPy views of CPU tensors. On the 2-core Xeon it was tuned on, a
torch call costs 2-8 us of dispatch even on 1792 elements and a stable torch sort of 1792
float64 survivals 63 us; the same algorithm written in torch ops took 118 / 120 / 128 / 232 us
per step at R = 1 / 8 / 64 / 256 (gamma 7) against 37 / 31 / 45 / 72 us in NumPy (see
benchmarks/planner_host.py for the figures of this file). Every NumPy call costs 1-3 us there
too, so the step makes few: the tier alignment bisects lists derived once per config, the rates
are a slice of ``TierRate``'s table (``rate_span_host``), and ``plan_lengths`` takes and gives
NumPy arrays for a host loop (e2e.py's), with no tensor made and read back. There is no Python
loop over requests. Survival is float32 and the sort key packs its 31 bits above the 32-bit
position-major index ``j * R + r``: one unstable int64 sort then yields (survival desc,
position asc, request asc) and is deterministic because no two keys are equal. Sums are float64.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ._checks import fraction
from .sps import SpsTable, StepRateModel, TierRate, check_rates

__all__ = ["PlannerConfig", "VerifyPlan", "Planner", "plan_verify", "plan_lengths", "survival"]

_CHECKED_RATES = (TierRate, SpsTable)
_INDEX_BITS = 32
_INDEX_MASK = (1 << _INDEX_BITS) - 1


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner picks the step's draft-token budget ``K``."""

    min_survival: float = 1e-6
    """Survivals below this are never candidates for the budget (worth < 1e-6 tokens each)."""
    budget_frac: float | None = None
    """Hard cap: ``K <= floor(budget_frac * R * gamma)``; None for no cap."""
    threshold: float | None = None
    """Confidence-threshold mode: verify every draft whose survival is >= this (no SPS)."""
    tiers: tuple[tuple[int, int], ...] = ()
    """``(tokens, request_slots)`` tiers to align the budget up to; empty for no alignment.

    A step runs in the smallest tier that holds ``R + K`` tokens and ``R`` requests and pays for
    all its tokens, so the budget grows to fill it (within the candidates and the cap)."""
    budget_lag: int = 0
    """Steps by which the budget's confidence lags the lengths' (0: both use the current one)."""
    flat_tolerance: float | None = 0.05
    """Verify every draft, without ranking, when the step rate at ``R * (gamma + 1)`` tokens
    is within this fraction of the best rate over ``R .. R * (gamma + 1)`` tokens. Expected
    tokens are largest with every draft verified, so no budget beats it by more than this
    fraction whatever the confidences, while the ranking's own host time is not in the rates
    (``benchmarks/e2e.py`` on the H200: 3.9% / 3.4% / 2.4% / 1.7% of a step at c = 1 / 8 / 64 /
    256); where the step cost is flat in tokens (small batches) the step is then the fixed full
    width's. None: always rank. Not used with ``threshold``, ``budget_frac`` or a lagged
    budget."""
    rank_cost_s: float = 0.0
    """Host seconds a ranked step costs beyond the full block (the ranking, and what the caller
    measures of the ragged step's packing). With it the flat rule reads: verify every draft
    when the most step time any budget could save, ``1 / SPS(R (gamma + 1)) - 1 / max SPS``
    over ``R .. R (gamma + 1)`` tokens, is at most ``flat_tolerance`` of the full step plus
    this cost: ranking cannot then pay for itself (0: the rule on rates alone)."""
    quiet_steps: int = 8
    """Steps that :class:`Planner` verifies whole, unranked, after a ranked step whose best
    budget was predicted to save no more than the flat rule's margin (``flat_tolerance`` of the
    full step plus ``rank_cost_s``) over verifying every candidate. The flat rule bounds what
    any budget could save by the rates alone; this reads what the ranking actually found, so
    where it keeps finding too little to pay for itself (a draft that is right about most of its
    tokens, a step cost that rises in steps of a tier) it is paid for once every
    ``quiet_steps + 1`` steps instead of every step. Then it ranks again. 0: rank every step.
    Where the flat rule applies only (a rate model, no ``threshold``, ``budget_frac`` or lagged
    budget); the stateless :func:`plan_verify`, :func:`plan_lengths` and the device planner
    rank every step."""

    def __post_init__(self) -> None:
        fraction("PlannerConfig.min_survival", self.min_survival)
        if self.budget_frac is not None:
            fraction("PlannerConfig.budget_frac", self.budget_frac)
        if self.threshold is not None:
            fraction("PlannerConfig.threshold", self.threshold)
        for i, tier in enumerate(self.tiers):
            if len(tier) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and
                                         v >= 1 for v in tier):
                raise ValueError(f"PlannerConfig.tiers[{i}]={tier!r} is not a (tokens, "
                                 "request_slots) pair of positive ints; fix the tier set")
        object.__setattr__(self, "tiers", tuple(sorted(tuple(t) for t in self.tiers)))
        if self.flat_tolerance is not None:
            fraction("PlannerConfig.flat_tolerance", self.flat_tolerance)
        if isinstance(self.rank_cost_s, bool) or not isinstance(self.rank_cost_s, (int, float)) \
                or not math.isfinite(self.rank_cost_s) or self.rank_cost_s < 0:
            raise ValueError(f"PlannerConfig.rank_cost_s={self.rank_cost_s!r} is not a finite "
                             "number of seconds >= 0; pass the host time a ranked step adds")
        if isinstance(self.quiet_steps, bool) or not isinstance(self.quiet_steps, int) or \
                self.quiet_steps < 0:
            raise ValueError(f"PlannerConfig.quiet_steps={self.quiet_steps!r} is not an int >= 0; "
                             "pass how many steps to verify whole after a ranking that did not "
                             "pay (0: rank every step)")
        if not isinstance(self.budget_lag, int) or self.budget_lag < 0:
            raise ValueError(f"PlannerConfig.budget_lag={self.budget_lag!r} is not an int >= 0; "
                             "pass the number of steps the budget may lag")
        # Sort-key bounds of the two cut-offs, derived once (see _key_bound); not fields.
        object.__setattr__(self, "_min_survival_key", _key_bound(self.min_survival))
        if self.threshold is not None:
            object.__setattr__(self, "_threshold_key", _key_bound(self.threshold))
        # Tier lookup by bisection (see _tier_tokens): the distinct request-slot counts, and per
        # count the sorted token counts of the tiers with at least that many slots.
        slots = sorted({s for _, s in self.tiers})
        object.__setattr__(self, "_tier_slots", tuple(slots))
        object.__setattr__(self, "_tier_tokens_from", tuple(
            tuple(sorted(t for t, s in self.tiers if s >= least)) for least in slots))

    def _tier_tokens(self, requests: int, tokens: int) -> int | None:
        """Tokens of the smallest tier holding ``requests`` requests and ``tokens`` tokens, or
        None: two bisections over lists derived once, where a scan of the ~70 tiers of
        ``tier_set(256, 8)`` took ~5 us per step."""
        i = bisect_left(self._tier_slots, requests)
        if i == len(self._tier_slots):
            return None
        fitting = self._tier_tokens_from[i]  # tiers with >= requests slots, by tokens
        j = bisect_left(fitting, tokens)
        return fitting[j] if j < len(fitting) else None


@dataclass(frozen=True)
class VerifyPlan:
    """One step's decision."""

    lens: torch.Tensor
    """int32 [R], CPU: verify length of each request, in ``[1, gamma + 1]``."""
    num_draft_tokens: int
    """K: draft tokens verified in total, ``sum(lens) - R``."""

    @property
    def num_tokens(self) -> int:
        """B = R + K: packed tokens of the verify step."""
        return self.lens.numel() + self.num_draft_tokens


def _host_confidence(confidence, name: str = "confidence") -> np.ndarray:
    """float32 [gamma, R] position-major NumPy copy of ``confidence [R, gamma]`` (a tensor or a
    NumPy array of real numbers), validated."""
    return _position_major(_checked_host(confidence, name))


def _position_major(host: np.ndarray) -> np.ndarray:
    """float32 [gamma, R] copy of a checked ``[R, gamma]``: transposed, and -0.0 turned into
    +0.0 (whose bits would sort as a negative key) by adding +0.0, in one pass."""
    return np.add(host.T, np.float32(0.0), order="C")


def _checked_host(confidence, name: str) -> np.ndarray:
    """``confidence [R, gamma]`` as a validated float32 NumPy array on the host (the array
    itself when it is one in float32): what the planner reads, before any ranking."""
    if isinstance(confidence, np.ndarray):
        if confidence.dtype.kind not in "fiu":
            raise ValueError(f"{name} has dtype {confidence.dtype}; it must be real numbers "
                             "(float32 or float64 probabilities)")
        host = confidence
    elif isinstance(confidence, torch.Tensor):
        host = None
    else:
        raise ValueError(f"{name} is a {type(confidence).__name__}; it must be a tensor or a "
                         "NumPy array [R, gamma]")
    if confidence.ndim != 2 or confidence.shape[0] < 1 or confidence.shape[1] < 1:
        raise ValueError(f"{name} has shape {tuple(confidence.shape)}; it must be [R >= 1, "
                         "gamma >= 1] (conditional acceptance per request and draft position)")
    if confidence.shape[0] * confidence.shape[1] > _INDEX_MASK:
        raise ValueError(f"{name} has {confidence.shape[0] * confidence.shape[1]} entries; the "
                         f"planner ranks at most {_INDEX_MASK} (split the batch)")
    if host is None:
        tensor = confidence.detach().cpu()
        if tensor.dtype not in (torch.float32, torch.float64):
            tensor = tensor.float()
        host = tensor.numpy()
    if host.dtype != np.float32:
        host = host.astype(np.float32)
    if not (host.min() >= 0.0 and host.max() <= 1.0):  # NaN fails both comparisons
        r, j = np.argwhere(~((host >= 0.0) & (host <= 1.0)))[0]
        raise ValueError(f"{name}[{r}, {j}]={host[r, j]} is not a probability in [0, 1]; "
                         "calibrate or clamp the draft's confidence")
    return host


def survival(confidence: torch.Tensor) -> torch.Tensor:
    """float32 [R, gamma] survival ``prod_{m <= j} c[r, m]``, as the planner ranks it."""
    surv = np.multiply.accumulate(_host_confidence(confidence), axis=0)  # [gamma, R]
    return torch.from_numpy(np.ascontiguousarray(surv.T))


def _rank(conf: np.ndarray) -> np.ndarray:
    """Sort keys (int64 [M], ascending) of the survivals of ``conf [gamma, R]``, M = R * gamma.

    ``key = index - (survival bits << 32)`` with ``index = j * R + r``: the bits of a
    non-negative float32 order like the float, so ascending keys are survivals descending,
    then positions ascending, then requests ascending; ``_survivals`` decodes them.
    """
    surv = np.multiply.accumulate(conf, axis=0)  # [gamma, R]
    keys = np.arange(surv.size, dtype=np.int64)  # [M]
    keys -= np.left_shift(surv.reshape(-1).view(np.int32), _INDEX_BITS, dtype=np.int64)
    keys.sort()
    return keys


def _survivals(keys: np.ndarray) -> np.ndarray:
    """float32 survivals of sort keys (the inverse of ``_rank``'s packing)."""
    return np.negative(keys >> _INDEX_BITS, dtype=np.int32).view(np.float32)


def _key_bound(p: float) -> int:
    """The least sort key of a survival < ``p`` (keys below it are the survivals >= ``p``).

    With ``b`` the bits of the least float32 >= ``p``, survivals >= ``p`` are exactly those with
    bits >= ``b``, i.e. keys ``index - (bits << 32) < (1 - b) << 32``.
    """
    least = np.float32(p)
    if float(least) < p:
        least = np.nextafter(least, np.float32(np.inf))
    return (1 - int(least.view(np.int32))) << _INDEX_BITS


def _at_least(keys: np.ndarray, key_bound: int) -> int:
    """How many ranked survivals pass a cut-off: one binary search over the sorted keys."""
    return int(keys.searchsorted(key_bound))


def _rate_span(rate: StepRateModel, first_tokens: int, count: int, requests: int) -> np.ndarray:
    """float64 [count] rates as a NumPy array: ``rate_span_host`` where the model has one (a
    view of its table, no tensor made and read back), else ``rate_span``. The rates of a model
    other than ``TierRate`` and ``SpsTable`` (whose values are checked when they are built) are
    checked here: a NaN rate would compare false with every other and silently turn
    speculation off; a short span would be broadcast."""
    host = getattr(rate, "rate_span_host", None)
    if host is not None:
        out = host(first_tokens, count, requests)
    else:
        out = rate.rate_span(first_tokens, count, requests)
        out = out.detach().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
    if type(rate) not in _CHECKED_RATES:
        check_rates(f"{type(rate).__name__}.rate_span({first_tokens}, {count}, {requests})",
                    out, count)
    return out


def _budget(keys: np.ndarray, r: int, rate: StepRateModel | None, config: PlannerConfig,
            candidates: int | None = None, unpaid: list | None = None) -> int:
    """K for the ranked keys of ``r`` requests (before cap and alignment); ``candidates``: the
    keys' count of survivals >= ``min_survival`` when the caller has it. ``unpaid``, if given,
    gets whether the best budget's predicted saving over verifying every candidate is within
    the flat rule's margin (``PlannerConfig.quiet_steps``), when the rates were read."""
    if config.threshold is not None:
        return _at_least(keys, config._threshold_key)
    if rate is None:
        return keys.size  # no table: verify everything
    n = _at_least(keys, config._min_survival_key) if candidates is None else candidates
    if not n:
        return 0
    rates = _rate_span(rate, r, n + 1, r)  # [n + 1]: SPS at B = R + k, k = 0..n
    # [n]: P_k, k = 1..n (add.accumulate is cumsum without its wrapper: 1.7 us less per step)
    theta = np.add.accumulate(_survivals(keys[:n]), dtype=np.float64)
    theta += r
    theta *= rates[1:]  # [n]: Theta(k) = (P_k + R) * SPS(R + k), k = 1..n
    best = int(theta.argmax())  # first maximum: ties go to the smallest k
    k = best + 1 if theta[best] > r * rates[0] else 0
    if unpaid is not None and config.flat_tolerance is not None:
        # the best step's expected tokens, made at the every-candidate rate instead: the time
        # that step saves (seconds), against the flat rule's margin
        best_theta = float(theta[best]) if k else r * float(rates[0])
        tokens = best_theta / float(rates[k])
        saved = tokens / float(theta[-1]) - tokens / best_theta
        unpaid.append(saved <= config.flat_tolerance / float(rates[n]) + config.rank_cost_s)
    return k


def _cap_and_align(k: int, candidates: int, r: int, gamma: int, config: PlannerConfig) -> int:
    """Apply the hard cap and the tier alignment to a budget ``k`` for ``r`` requests with
    ``candidates`` survivals >= ``min_survival``."""
    cap = r * gamma
    if config.budget_frac is not None:
        cap = min(cap, math.floor(config.budget_frac * r * gamma))
    k = min(k, cap)
    if config.tiers:
        tokens = config._tier_tokens(r, r + k)
        if tokens is not None:
            k = max(k, min(tokens - r, candidates, cap))
    return k


def _flat(rate: StepRateModel | None, r: int, gamma: int, config: PlannerConfig) -> bool:
    """Whether every draft is verified without ranking (``PlannerConfig.flat_tolerance``)."""
    if rate is None or config.flat_tolerance is None or config.threshold is not None or \
            config.budget_frac is not None:
        return False
    rates = _rate_span(rate, r, r * gamma + 1, r)  # [R * gamma + 1]: B = R .. R (gamma + 1)
    return bool(flat_rule(rates[-1], rates.max(), config))


def flat_rule(full, best, config: PlannerConfig):
    """``PlannerConfig.rank_cost_s``'s rule on the step rate of the full block and the best
    rate (float64 scalars or tensors; the device planner applies the same expression)."""
    return 1.0 / full - 1.0 / best <= config.flat_tolerance / full + config.rank_cost_s


def _full(r: int, gamma: int) -> tuple[np.ndarray, int]:
    """Every draft verified: lengths ``gamma + 1`` and K = ``R * gamma``."""
    return np.full(r, gamma + 1, dtype=np.int32), r * gamma


def _plan(conf: np.ndarray, budget_conf: np.ndarray | None, rate: StepRateModel | None,
          config: PlannerConfig) -> tuple[np.ndarray, int]:
    """Lengths (int32 [R]) and K from position-major host confidences ``conf [gamma, R]`` (and
    a lagged one)."""
    gamma, r = conf.shape
    if budget_conf is None and _flat(rate, r, gamma, config):
        return _full(r, gamma)
    return _plan_ranked(conf, budget_conf, rate, config)


def _plan_checked(host: np.ndarray, rate: StepRateModel | None, config: PlannerConfig,
                  unpaid: list | None = None) -> tuple[np.ndarray, int]:
    """:func:`_plan` of a checked ``[R, gamma]`` confidence with no lagged one: under the flat
    rule no ranking and no copy; else ranked (``unpaid``: :func:`_budget`'s)."""
    r, gamma = host.shape
    if _flat(rate, r, gamma, config):
        return _full(r, gamma)
    return _plan_ranked(_position_major(host), None, rate, config, unpaid)


def _plan_ranked(conf: np.ndarray, budget_conf: np.ndarray | None,
                 rate: StepRateModel | None, config: PlannerConfig,
                 unpaid: list | None = None) -> tuple[np.ndarray, int]:
    """:func:`_plan` past the flat rule: rank the drafts and take the budget's best
    (``unpaid``: :func:`_budget`'s)."""
    gamma, r = conf.shape
    keys = _rank(conf)  # [R * gamma]
    candidates = _at_least(keys, config._min_survival_key)
    if budget_conf is None:
        k = _budget(keys, r, rate, config, candidates, unpaid)
    else:
        if budget_conf.shape[0] != gamma:
            raise ValueError(f"budget confidence has gamma={budget_conf.shape[0]} but the "
                             f"confidence has gamma={gamma}; both must come from one drafter")
        k = _budget(_rank(budget_conf), budget_conf.shape[1], rate, config)
        if rate is not None or config.threshold is not None:
            k = min(k, candidates)  # no sub-candidate drafts
    k = _cap_and_align(k, candidates, r, gamma, config)
    if r == 1:  # every pick is request 0's
        return np.array([1 + k], dtype=np.int32), k
    requests = keys[:k] & _INDEX_MASK  # [K]: j * R + r of each pick
    requests %= r
    lens = np.bincount(requests, minlength=r)  # [R]
    return np.add(lens, 1, dtype=np.int32), k


def plan_lengths(confidence, rate: StepRateModel | None, config: PlannerConfig = PlannerConfig(),
                 budget_confidence=None) -> np.ndarray:
    """:func:`plan_verify`'s lengths as an int32 NumPy array [R], for a host loop that keeps its
    state in NumPy: ``confidence`` (and ``budget_confidence``) may be NumPy arrays, validated
    the same way, and no tensor is made (each torch call costs microseconds on the host)."""
    return _plan_inputs(confidence, rate, config, budget_confidence)[0]


def _plan_inputs(confidence, rate: StepRateModel | None, config: PlannerConfig,
                 budget_confidence) -> tuple[np.ndarray, int]:
    """``_plan`` of validated host copies of the confidences (lengths, K)."""
    if budget_confidence is None:
        return _plan_checked(_checked_host(confidence, "confidence"), rate, config)
    lagged = _host_confidence(budget_confidence, "budget_confidence")
    return _plan(_host_confidence(confidence), lagged, rate, config)


def plan_verify(confidence: torch.Tensor, rate: StepRateModel | None,
                config: PlannerConfig = PlannerConfig(),
                budget_confidence: torch.Tensor | None = None) -> VerifyPlan:
    """Plan one step: budget from ``budget_confidence`` (default: ``confidence``), lengths from
    ``confidence [R, gamma]``. ``rate=None`` verifies everything (unless ``config.threshold``).

    A lagged ``budget_confidence`` may come from a batch of other requests (``[R', gamma]``); its
    budget is then clipped to the current step's candidates and cap. Device tensors are copied
    to the host (this is the host reference); NumPy arrays are taken as they are.
    """
    lens, k = _plan_inputs(confidence, rate, config, budget_confidence)
    return VerifyPlan(lens=torch.from_numpy(lens), num_draft_tokens=k)


class Planner:
    """Stateful wrapper of :func:`plan_verify`: keeps the last ``budget_lag`` confidences, and
    the steps left to verify whole after a ranking that did not pay
    (``PlannerConfig.quiet_steps``)."""

    def __init__(self, rate: StepRateModel | None, config: PlannerConfig = PlannerConfig()):
        self.rate = rate
        self.config = config
        self._history: deque[np.ndarray] = deque(maxlen=config.budget_lag + 1)
        self._quiet = 0  # steps left to verify whole, unranked
        c = config
        self._may_quiet = (rate is not None and c.quiet_steps > 0 and c.budget_lag == 0 and
                           c.flat_tolerance is not None and c.threshold is None and
                           c.budget_frac is None)

    def follow(self, rate: StepRateModel | None, config: PlannerConfig) -> "Planner":
        """This planner while it plans with ``rate`` and ``config`` (the same objects), else a
        fresh one for them: for a caller whose rate or config may be swapped between steps."""
        if self.rate is rate and self.config is config:
            return self
        return Planner(rate, config)

    def __call__(self, confidence: torch.Tensor) -> VerifyPlan:
        """Plan this step; the budget uses the confidence of ``budget_lag`` steps ago (the
        oldest one held during the first steps)."""
        lens, k = self._step(confidence)
        return VerifyPlan(lens=torch.from_numpy(lens), num_draft_tokens=k)

    def lengths(self, confidence) -> np.ndarray:
        """This step's lengths as an int32 NumPy array [R] (:func:`plan_lengths`'s form, for a
        host loop in NumPy), with the same state as ``__call__``."""
        return self._step(confidence)[0]

    def _step(self, confidence) -> tuple[np.ndarray, int]:
        if self.config.budget_lag:
            conf = _host_confidence(confidence)
            self._history.append(conf)  # a fresh array: later steps cannot change it
            lagged = self._history[0]
            return _plan(conf, None if lagged is conf else lagged, self.rate, self.config)
        host = _checked_host(confidence, "confidence")  # checked on quiet steps too
        if self._quiet:
            self._quiet -= 1
            return _full(*host.shape)
        unpaid = [] if self._may_quiet else None
        lens, k = _plan_checked(host, self.rate, self.config, unpaid)
        if unpaid and unpaid[0]:
            self._quiet = self.config.quiet_steps
        return lens, k
