"""Steps-per-second (SPS) cost tables: what a verify step of ``B`` tokens costs on one machine.

The planner and the width policy trade expected accepted tokens against step rate, so they need
``SPS(B)`` (optionally ``SPS(B, R)`` for ``R`` requests). Two models answer that question:

- :class:`SpsTable`, measured points stored as JSON with metadata (GPU, model, versions, tier
  set). Lookup *floors* to the nearest measured point below and never interpolates: a hardware
  cliff between two tiers (T=3 slower than T=8 at bs 256 on the H200, see DESIGN.md) must stay
  visible to the planner instead of being smoothed over.
- :class:`AdditiveStepModel`, ``T = bias + a(R) + t(R + k)`` fitted by least squares from runs
  with a pinned budget ``k``; ``a`` and ``t`` are clamped linear interpolants over their knots.

Both expose ``steps_per_second(tokens, requests) -> float64 tensor`` (:class:`StepRateModel`).
Files are JSON only; a table is never unpickled.
"""

from __future__ import annotations

import json
import math
import statistics
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple, Protocol

import numpy as np
import torch

from ._checks import positive_int

__all__ = [
    "TierRate",
    "SPS_SCHEMA",
    "StepRateModel",
    "SpsMetadata",
    "SpsEntry",
    "SpsSample",
    "SpsTable",
    "table_from_samples",
    "check_rates",
]

SPS_SCHEMA = "dspark_compile.sps_table/1"
"""Value of the ``schema`` key of every SPS table file this version reads and writes."""
_MAX_TOKENS = 1 << 20  # lookup keeps a rate per B up to the largest point: 8 MiB at this bound

_TOP_KEYS = {"schema", "metadata", "entries"}
_META_KEYS = {"gpu", "model", "versions", "tiers"}
_ENTRY_KEYS = {"tokens", "steps_per_second", "requests"}


class StepRateModel(Protocol):
    """Anything that tells the verify step rate at ``tokens`` packed tokens and ``requests``."""

    def steps_per_second(self, tokens: torch.Tensor, requests: int) -> torch.Tensor:
        """float64 steps per second, one per entry of the integer tensor ``tokens``."""
        ...

    def rate_span(self, first_tokens: int, count: int, requests: int) -> torch.Tensor:
        """float64 [count]: steps per second at ``B = first_tokens, ..., first_tokens+count-1``."""
        ...

    # Optional, for the host planner: ``rate_span_host(first_tokens, count, requests) ->
    # np.ndarray``, the same rates as a NumPy array (``SpsTable`` and ``TierRate`` have it).


@dataclass(frozen=True)
class SpsMetadata:
    """Where and on what a table was measured; saved with it so that tables are not mixed up."""

    gpu: str
    """Accelerator name as the driver reports it, e.g. ``"NVIDIA H200"``."""
    model: str
    """Model the verify step ran, e.g. a Hugging Face id or a local path."""
    versions: tuple[tuple[str, str], ...] = ()
    """(package, version) pairs, sorted by package, e.g. ``(("torch", "2.11.0"),)``."""
    tiers: tuple[tuple[int, int], ...] = ()
    """CUDA-graph tiers the run had captured, as sorted ``(tokens, request_slots)`` pairs."""


@dataclass(frozen=True)
class SpsEntry:
    """One measured point of a table."""

    tokens: int
    """B: packed tokens of the verify step (all requests together), >= 1."""
    steps_per_second: float
    """Measured verify steps per second at this point; finite and > 0."""
    requests: int | None = None
    """R: requests in the step, or None for a table keyed by tokens alone."""


class SpsSample(NamedTuple):
    """One timed verify step, as the profiler records it."""

    tokens: int
    """B: packed tokens of the step."""
    seconds: float
    """Wall time of the step in seconds; finite and > 0."""
    requests: int | None = None
    """R: requests in the step, or None when the table is keyed by tokens alone."""


def _bad(where: str, value, rule: str, fix: str) -> ValueError:
    """The error for ``where=value``: what rule it breaks and how to fix it."""
    return ValueError(f"{where}={value!r} {rule}; {fix}")


@dataclass(frozen=True)
class SpsTable:
    """Measured SPS points. Entries sorted by ``(requests, tokens)``, B strictly increasing per R.

    With ``requests`` set on the entries, lookup first floors ``R`` to the largest measured
    request count ``<= R`` (the smallest one when ``R`` is below all), then floors ``B`` within it.
    ``B`` below the first measured point takes the first point's rate.
    """

    metadata: SpsMetadata
    """Machine, model, versions and tier set of the measurement."""
    entries: tuple[SpsEntry, ...]
    """The measured points, sorted by ``(requests, tokens)``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        _check_entries(self.entries, "SpsTable")
        dense: dict[int | None, torch.Tensor] = {}
        for key in sorted({e.requests for e in self.entries}, key=lambda r: r or 0):
            rows = [e for e in self.entries if e.requests == key]
            measured = torch.tensor([e.tokens for e in rows])  # [P]
            sps = torch.tensor([e.steps_per_second for e in rows], dtype=torch.float64)  # [P]
            idx = torch.searchsorted(measured, torch.arange(rows[-1].tokens + 1), right=True) - 1
            dense[key] = sps[idx.clamp_(min=0)]  # [B_max + 1]: the floored rate at every B
        # Derived lookup tensors; not dataclass fields, so equality compares the entries only.
        object.__setattr__(self, "_dense", dense)
        object.__setattr__(self, "_dense_host", {k: v.numpy() for k, v in dense.items()})
        object.__setattr__(self, "_request_keys", tuple(dense))

    # ------------------------------------------------------------------ lookup
    def _group(self, requests: int) -> int | None:
        """The measured request count that ``requests`` floors to (None: tokens-only table)."""
        keys = self._request_keys
        if keys == (None,):
            return None
        below = bisect_right(keys, requests)  # keys are sorted
        return keys[below - 1] if below else keys[0]

    def steps_per_second(self, tokens: torch.Tensor, requests: int) -> torch.Tensor:
        """float64 SPS at each entry of ``tokens`` (any shape), floored to the measured points."""
        dense = self._dense[self._group(requests)]  # [B_max + 1]
        return dense[tokens.to(torch.int64).clamp(0, dense.numel() - 1)]

    def rate_span(self, first_tokens: int, count: int, requests: int) -> torch.Tensor:
        """float64 [count] SPS at consecutive ``B`` from ``first_tokens``; read-only (a view of
        the table when it can be).

        The planner asks for ``B = R .. R + R * gamma`` every step; slicing a per-B array built
        once costs one view instead of a search per step.
        """
        dense = self._dense[self._group(requests)]  # [B_max + 1]
        stop = first_tokens + count
        if stop <= dense.numel():
            return dense[first_tokens:stop]
        inside = dense[min(first_tokens, dense.numel()):]
        return torch.cat([inside, dense[-1:].expand(count - inside.numel())])

    def rate_span_host(self, first_tokens: int, count: int, requests: int) -> np.ndarray:
        """``rate_span`` as a NumPy array (a view of the table when it can be), for the host
        planner."""
        dense = self._dense_host[self._group(requests)]  # [B_max + 1]
        if first_tokens + count <= dense.size:
            return dense[first_tokens:first_tokens + count]
        return self.rate_span(first_tokens, count, requests).numpy()

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        """The table as a JSON-ready dict (see :data:`SPS_SCHEMA`)."""
        meta = self.metadata
        entries = []
        for e in self.entries:
            row = {"tokens": e.tokens, "steps_per_second": e.steps_per_second}
            if e.requests is not None:
                row["requests"] = e.requests
            entries.append(row)
        return {
            "schema": SPS_SCHEMA,
            "metadata": {
                "gpu": meta.gpu,
                "model": meta.model,
                "versions": dict(meta.versions),
                "tiers": [list(t) for t in meta.tiers],
            },
            "entries": entries,
        }

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (NaN and Inf refused by the writer as well)."""
        text = json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False)
        Path(path).write_text(text + "\n")

    @classmethod
    def from_json(cls, data, source: str = "SPS table") -> "SpsTable":
        """Validate a parsed JSON document and build the table; ``source`` names it in errors."""
        if not isinstance(data, dict):
            raise _bad(source, type(data).__name__, "is not a JSON object",
                       f"write an object with keys {sorted(_TOP_KEYS)}")
        _check_keys(data, _TOP_KEYS, _TOP_KEYS, source)
        if data["schema"] != SPS_SCHEMA:
            raise _bad(f"{source}: schema", data["schema"], f"is not {SPS_SCHEMA!r}",
                       "re-profile with this version of dspark_compile")
        metadata = _parse_metadata(data["metadata"], f"{source}: metadata")
        raw = data["entries"]
        if not isinstance(raw, list) or not raw:
            raise _bad(f"{source}: entries", raw, "is not a non-empty list",
                       "store at least one measured point")
        entries = tuple(_parse_entry(e, f"{source}: entries[{i}]") for i, e in enumerate(raw))
        _check_entries(entries, f"{source}: entries")
        return cls(metadata=metadata, entries=entries)

    @classmethod
    def load(cls, path: str | Path) -> "SpsTable":
        """Read and validate a JSON table; a bad file raises ``ValueError`` naming the entry."""
        try:
            data = json.loads(Path(path).read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON ({err}); SPS tables are JSON files") from err
        return cls.from_json(data, source=str(path))


# ---------------------------------------------------------------------- validation helpers
def _check_keys(obj: dict, required: set, allowed: set, where: str) -> None:
    """Refuse a JSON object that lacks a required key or has one outside ``allowed``."""
    missing = sorted(required - obj.keys())
    extra = sorted(obj.keys() - allowed)
    if missing:
        raise _bad(where, sorted(obj), f"lacks key(s) {missing}", f"provide {sorted(required)}")
    if extra:
        raise _bad(where, sorted(obj), f"has unknown key(s) {extra}",
                   f"use only {sorted(allowed)}")


def _parse_metadata(meta, where: str) -> SpsMetadata:
    """Validate the ``metadata`` object of a table file."""
    if not isinstance(meta, dict):
        raise _bad(where, meta, "is not an object", f"write an object with {sorted(_META_KEYS)}")
    _check_keys(meta, _META_KEYS, _META_KEYS, where)
    for key in ("gpu", "model"):
        if not isinstance(meta[key], str) or not meta[key]:
            raise _bad(f"{where}.{key}", meta[key], "is not a non-empty string", "name it")
    versions = meta["versions"]
    if not isinstance(versions, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in versions.items()
    ):
        raise _bad(f"{where}.versions", versions, "is not an object of strings",
                   'write e.g. {"torch": "2.11.0"}')
    tiers = meta["tiers"]
    if not isinstance(tiers, list):
        raise _bad(f"{where}.tiers", tiers, "is not a list", "write [[tokens, request_slots], ...]")
    parsed = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, list) or len(tier) != 2:
            raise _bad(f"{where}.tiers[{i}]", tier, "is not a [tokens, request_slots] pair",
                       "write two positive integers")
        parsed.append((positive_int(f"{where}.tiers[{i}][0]", tier[0]),
                       positive_int(f"{where}.tiers[{i}][1]", tier[1])))
    return SpsMetadata(gpu=meta["gpu"], model=meta["model"],
                       versions=tuple(sorted(versions.items())), tiers=tuple(sorted(parsed)))


def _parse_entry(entry, where: str) -> SpsEntry:
    """Validate the keys and integer fields of one ``entries`` item (rates: _check_entries)."""
    if not isinstance(entry, dict):
        raise _bad(where, entry, "is not an object", 'write {"tokens": B, "steps_per_second": x}')
    _check_keys(entry, {"tokens", "steps_per_second"}, _ENTRY_KEYS, where)
    requests = entry.get("requests")
    return SpsEntry(
        tokens=positive_int(f"{where}.tokens", entry["tokens"]),
        steps_per_second=entry["steps_per_second"],
        requests=None if requests is None else positive_int(f"{where}.requests", requests),
    )


def _check_entries(entries: tuple[SpsEntry, ...], where: str) -> None:
    """Finite positive rates, one key kind, sorted by R, B strictly increasing within each R."""
    if not entries:
        raise _bad(where, entries, "is empty", "store at least one measured point")
    keyed = entries[0].requests is not None
    for i, e in enumerate(entries):
        at = f"{where}[{i}]"
        if positive_int(f"{at}.tokens", e.tokens) > _MAX_TOKENS:
            raise _bad(f"{at}.tokens", e.tokens, f"exceeds {_MAX_TOKENS} tokens in one step",
                       "check the profiler's units (tokens per step, not per run)")
        rate = e.steps_per_second
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
            math.isfinite(rate) and rate > 0
        ):
            raise _bad(f"{at}.steps_per_second", rate, "is not a finite number > 0",
                       "drop or re-measure this point")
        if (e.requests is not None) != keyed:
            raise _bad(f"{at}.requests", e.requests,
                       "mixes request-keyed and token-only entries in one table",
                       "set requests on every entry or on none")
        if i and keyed and e.requests < entries[i - 1].requests:
            raise _bad(f"{at}.requests", e.requests, "is smaller than the entry before",
                       "sort entries by (requests, tokens)")
        if i and e.requests == entries[i - 1].requests and e.tokens <= entries[i - 1].tokens:
            raise _bad(f"{at}.tokens", e.tokens,
                       f"is not above the previous entry's {entries[i - 1].tokens}",
                       "keep tokens strictly increasing (one point per B, sorted)")


# ---------------------------------------------------------------------- profiler support
def table_from_samples(samples: Iterable[SpsSample], metadata: SpsMetadata) -> SpsTable:
    """Turn timed steps into a table: median seconds per ``(R, B)``, rate = 1 / median.

    The median (mean of the two middle values for an even count) keeps one preempted step from
    moving a point; the profiler records several steps per point and calls this.
    """
    by_point: dict[tuple[int, int], list[float]] = {}
    keyed = None
    for i, raw in enumerate(samples):
        sample = SpsSample(*raw)
        where = f"samples[{i}]"
        tokens = positive_int(f"{where}.tokens", sample.tokens)
        seconds = sample.seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds > 0
        ):
            raise _bad(f"{where}.seconds", seconds, "is not a finite number > 0",
                       "drop the failed measurement")
        if keyed is None:
            keyed = sample.requests is not None
        if (sample.requests is not None) != keyed:
            raise _bad(f"{where}.requests", sample.requests, "mixes keyed and unkeyed samples",
                       "record requests on every sample or on none")
        requests = positive_int(f"{where}.requests", sample.requests) if keyed else 0
        by_point.setdefault((requests, tokens), []).append(float(seconds))
    if not by_point:
        raise _bad("samples", [], "is empty", "time at least one step")
    entries = tuple(
        SpsEntry(tokens=b, steps_per_second=1.0 / statistics.median(times),
                 requests=r if keyed else None)
        for (r, b), times in sorted(by_point.items())
    )
    return SpsTable(metadata=metadata, entries=entries)


def check_rates(where: str, rates, count: int) -> np.ndarray:
    """Refuse step rates that are not ``count`` finite numbers > 0 (a rate model's output)."""
    arr = np.asarray(rates)
    if arr.shape != (count,):
        raise ValueError(f"{where} returned shape {arr.shape}; a rate model must return one "
                         f"rate per token count asked, [{count}]")
    if arr.dtype.kind not in "fiu" or not (arr.min() > 0 and np.isfinite(arr).all()):
        bad = arr if arr.dtype.kind not in "fiu" else arr[~(np.isfinite(arr) & (arr > 0))][:3]
        raise ValueError(f"{where} returned {bad!r}; steps per second must be finite numbers "
                         "> 0 (a NaN or a zero would silently change every decision)")
    return arr


def _tier_pair(i: int, t) -> tuple[int, int]:
    pair = (t.tokens, t.request_slots) if hasattr(t, "request_slots") else tuple(t)
    if len(pair) != 2:
        raise ValueError(f"TierRate: tiers[{i}]={t!r} is not a Tier or a (tokens, "
                         "request_slots) pair")
    tokens = positive_int(f"TierRate: tiers[{i}] tokens", pair[0])
    slots = positive_int(f"TierRate: tiers[{i}] request_slots", pair[1])
    if tokens < slots:
        raise ValueError(f"TierRate: tiers[{i}]={t!r} has fewer tokens than request slots; "
                         "every request verifies at least one token")
    return tokens, slots


class TierRate:
    """``StepRateModel`` of tier-graph steps: the table read at the tier a step replays.

    ``SpsTable`` floors ``B`` to the measured point below, but a step of ``B`` tokens over ``R``
    requests replays the smallest captured tier holding both, and pays for all of its tokens:
    read through the floor, ``B`` just past a tier boundary looks as cheap as the tier below.
    Rates per ``(R, B)`` are precomputed here (one table lookup per tier), so a step only
    slices an array. ``tiers``: ``(tokens, request_slots)`` pairs or ``Tier`` objects; ``B``
    past the largest tier reads the largest one, ``R`` past ``max_requests`` the last row.

    ``step_overhead_s``: the engine loop's fixed cost per step that a table of graph replays
    leaves out (planning, packing, the accept kernel and its copy to the host, commit); a step
    then takes ``1 / SPS + step_overhead_s``. A fixed cost per step makes a longer verify
    relatively cheaper, so a planner fed replay rates alone verifies too little.
    """

    def __init__(self, table: StepRateModel, tiers, max_requests: int,
                 step_overhead_s: float = 0.0) -> None:
        pairs = sorted({_tier_pair(i, t) for i, t in enumerate(tiers)})
        positive_int("TierRate: max_requests", max_requests)
        if not pairs:
            raise ValueError("TierRate: tiers is empty; it needs at least one tier")
        if isinstance(step_overhead_s, bool) or not (
                isinstance(step_overhead_s, (int, float)) and 0 <= step_overhead_s < 1):
            raise ValueError(f"TierRate: step_overhead_s={step_overhead_s!r}; it must be seconds "
                             "in [0, 1)")
        tokens = np.array([t for t, _ in pairs])
        slots = np.array([r for _, r in pairs])
        rates = np.array([float(table.steps_per_second(torch.tensor([t]), r)[0])
                          for t, r in pairs])
        check_rates(f"TierRate: {type(table).__name__}.steps_per_second at tiers {pairs}", rates,
                    len(pairs))
        rates = 1.0 / (1.0 / rates + step_overhead_s)
        self.dense = np.zeros((max_requests + 1, int(tokens.max()) + 1))  # [R + 1, B + 1]
        for r in range(1, max_requests + 1):
            fits = slots >= r
            if not fits.any():  # more requests than any tier holds: the largest tiers
                fits = slots == slots.max()
            first = np.searchsorted(tokens[fits], np.arange(self.dense.shape[1]), side="left")
            self.dense[r] = rates[fits][np.minimum(first, fits.sum() - 1)]

    def steps_per_second(self, tokens: torch.Tensor, requests: int) -> torch.Tensor:
        row = self.dense[min(requests, self.dense.shape[0] - 1)]
        return torch.from_numpy(row)[tokens.to(torch.int64).clamp(0, row.size - 1)]

    def rate_span(self, first_tokens: int, count: int, requests: int) -> torch.Tensor:
        """float64 [count] SPS at consecutive ``B`` from ``first_tokens``; read-only (a view of
        the table when the span lies inside it)."""
        return torch.from_numpy(self.rate_span_host(first_tokens, count, requests))

    def rate_span_host(self, first_tokens: int, count: int, requests: int) -> np.ndarray:
        """``rate_span`` as a NumPy array, for the host planner: a slice of the table's row when
        the span lies inside it (the planner's ``B = R .. R + R * gamma`` always does), with no
        index array built per step."""
        row = self.dense[min(requests, self.dense.shape[0] - 1)]  # [B_max + 1]
        stop = first_tokens + count
        if stop <= row.size:
            return row[first_tokens:stop]
        return row[np.minimum(np.arange(first_tokens, stop), row.size - 1)]
