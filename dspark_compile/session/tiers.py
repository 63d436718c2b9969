"""Token tiers: the geometries a verify forward is captured at.

A tier is ``(tokens, request_slots)``, keyed by geometry and not by token count alone: a graph
captured for 192 requests x 1 token must never be replayed for 32 requests x 6 tokens with a
request table sized for fewer slots. A batch of ``N`` tokens over ``R`` requests takes the
smallest tier with ``tokens >= N`` and ``request_slots >= R``. A uniform verify (every request
``w`` tokens, the full block included) is the tier ``(R_t * w, R_t)``, so the per-step width
policy and the ragged planner share one graph family.

Two exceptions, both for the same reason: ``torch.compile`` specialises a size of 1 and would
compile the whole model once more for it (15.6 s of a 40 s capture for the 1.1B benchmark
model on an H200, for the token axis). ``tier_set`` has no one-token tier (a single one-token
request replays ``(2, 2)`` with one padding row) and, when ``max_requests >= 2``, no one-slot
tier: a single request of ``w`` tokens replays ``(w, 2)``, whose second slot is an empty
request (no rows, no work).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["Tier", "tier_set", "select_tier", "format_tiers"]


@dataclass(frozen=True, order=True)
class Tier:
    """One captured geometry. Ordered by tokens, then request slots."""

    tokens: int
    """Rows of the packed batch the graph runs (real rows plus padding)."""
    request_slots: int
    """Requests the graph's metadata has room for (real requests plus empty ones)."""

    def __post_init__(self) -> None:
        for name in ("tokens", "request_slots"):  # NumPy integers are taken as ints
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise ValueError(f"Tier.{name}={value!r}; it must be an int")
            object.__setattr__(self, name, int(value))
        if self.request_slots < 1 or self.tokens < self.request_slots:
            raise ValueError(
                f"Tier(tokens={self.tokens}, request_slots={self.request_slots}): every request "
                "verifies at least one token, so tokens >= request_slots >= 1")

    def fits(self, num_tokens: int, num_requests: int) -> bool:
        return num_tokens <= self.tokens and num_requests <= self.request_slots


def _request_tiers(max_requests: int) -> list[int]:
    sizes, r = [], 1
    while r < max_requests:
        sizes.append(r)
        r *= 2
    return sizes + [max_requests]


def tier_set(max_requests: int, block: int, widths: tuple[int, ...] | None = None
             ) -> tuple[Tier, ...]:
    """Tiers for up to ``max_requests`` requests verifying up to ``block`` tokens each.

    Request slots go in powers of two up to ``max_requests``; for each, the token counts are
    ``slots * w`` for every width ``w`` in ``widths`` (default ``1..block``), so every uniform
    width has an exact tier and a ragged batch pads to the next width up. The smallest tier
    has 2 tokens and, given ``max_requests >= 2``, every tier at least 2 request slots (see
    the module docstring), so ``block >= 2`` or ``max_requests >= 2``.
    """
    if max_requests < 1 or block < 1:
        raise ValueError(f"tier_set: max_requests={max_requests}, block={block}; both must be "
                         ">= 1")
    widths = tuple(range(1, block + 1)) if widths is None else tuple(sorted(set(widths)))
    bad = [w for w in widths if not 1 <= w <= block]
    if bad or block not in widths:
        raise ValueError(f"tier_set: widths={widths}; each must be in 1..block={block} and the "
                         "full block must be among them")
    least = min(2, max_requests)
    tiers = {Tier(r * w, max(r, least)) for r in _request_tiers(max_requests) for w in widths
             if r * w >= 2}
    if not tiers:
        raise ValueError(f"tier_set: max_requests={max_requests}, block={block}, widths="
                         f"{widths} give only the one-token tier; verify at least 2 tokens")
    return tuple(sorted(tiers))


def select_tier(tiers: tuple[Tier, ...], num_tokens: int, num_requests: int) -> Tier | None:
    """The smallest tier holding ``num_tokens`` rows over ``num_requests`` requests, or None."""
    best = None
    for tier in tiers:
        if tier.fits(num_tokens, num_requests) and (
                best is None or (tier.tokens, tier.request_slots) <
                (best.tokens, best.request_slots)):
            best = tier
    return best


def format_tiers(tiers: tuple[Tier, ...]) -> str:
    """The tier set as a table: one row per request-slot count, its token counts."""
    rows: dict[int, list[int]] = {}
    for t in tiers:
        rows.setdefault(t.request_slots, []).append(t.tokens)
    width = max(len("slots"), *(len(str(r)) for r in rows))
    lines = [f"{'slots':>{width}} | tokens"]
    for r in sorted(rows):
        lines.append(f"{r:>{width}} | " + " ".join(str(n) for n in sorted(rows[r])))
    return "\n".join(lines)
