"""Width decisions vs batch size: the uniform verify width ``WidthPolicy`` picks at bs = 1..256.

For each SPS table and each acceptance profile (hazard ``h_j`` per draft position, gamma 7) a
fresh ``WidthPolicy`` over widths 1..8 (default knobs, ``histogram_lag=0``) observes one
full-width step's histogram of 1000 requests drawn exactly from the hazards, so every position
is measured; its first choice is the refresh step (full width), the second is the decision
plotted. No state carries from one bs to the next (the switch margin would make the curve
depend on the sweep order). The rate model is the table read at the tier a step replays
(``dspark_compile.runtime.TierRate``, over the tiers in the table's metadata), as the engine
pays it; a table without tiers is read as is (floored).

Tables:
- ``synthetic``: always. Step time ``1 + 0.006 * B`` ms at every tier of ``tier_set(256, 8)``.
  With hazards that collapse after five drafts (``MI355X_HAZARDS``, as in
  ``tests/runtime/test_runtime_width.py``) it gives the MI355X sweep's best widths: 6 up to bs 8,
  4 at bs 64, 3 at bs 128-256. Its figures are synthetic, not a measurement.
- ``--table PATH`` (repeatable), by default ``benchmarks/results/sps_h200.json`` if it exists
  (``python -m dspark_compile profile-sps ... --out benchmarks/results/sps_h200.json``). bs runs
  up to the largest request-slot count in its tiers.

Writes per table ``width_decisions_<label>.png`` (top: width picked; bottom: expected tokens/s of
that width over the full width's), ``width_decisions_<label>.json`` and ``sps_curve_<label>.png``
(``profiler.plot_sps``) to ``--out`` (default ``benchmarks/results``). CPU only, a few seconds.

Usage: ``python benchmarks/width_decisions.py [--table PATH ...] [--synthetic-only] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from dspark_compile.session.tiers import Tier, tier_set
from dspark_compile.runtime import (SpsEntry, SpsMetadata, SpsTable, WidthPolicy,
                                    WidthPolicyConfig, expected_tokens)
from dspark_compile.runtime.profiler import plot_sps
from dspark_compile.runtime import TierRate

GAMMA = 7
WIDTHS = tuple(range(1, GAMMA + 2))
MAX_BS = 256
RESULTS = Path(__file__).parent / "results"
DEFAULT_TABLE = RESULTS / "sps_h200.json"
MI355X_HAZARDS = (0.9, 0.82, 0.74, 0.66, 0.58, 0.05, 0.05)
"""Hazards the synthetic table was shaped with (tests/runtime/test_runtime_width.py)."""
MI355X_BEST = {1: 6, 2: 6, 4: 6, 8: 6, 64: 4, 128: 3, 256: 3}
"""Best widths of the MI355X sweep that the synthetic table reproduces with MI355X_HAZARDS."""
PROFILES = {
    "collapse after 5 (MI355X shape)": MI355X_HAZARDS,
    "constant 0.9": (0.9,) * GAMMA,
    "constant 0.75": (0.75,) * GAMMA,
    "constant 0.6": (0.6,) * GAMMA,
    "decaying 0.95 * 0.9^j": tuple(round(0.95 * 0.9 ** j, 4) for j in range(GAMMA)),
}
REQUESTS_PER_HIST = 1000.0


def synthetic_table() -> SpsTable:
    """Step time 1 + 0.006 * B ms at every tier (tokens, slots) of tier_set(256, 8), keyed by
    request slots as ``profile_sps`` writes a measured table."""
    tiers = tier_set(MAX_BS, GAMMA + 1)
    meta = SpsMetadata(gpu="synthetic (MI355X sweep shape)", model="step ms = 1 + 0.006 * B",
                       tiers=tuple((t.tokens, t.request_slots) for t in tiers))
    entries = sorted((t.request_slots, t.tokens) for t in tiers)
    return SpsTable(meta, tuple(SpsEntry(b, 1000.0 / (1.0 + 0.006 * b), r) for r, b in entries))


def histogram(hazards: tuple[float, ...], width: int) -> torch.Tensor:
    """float64 [gamma + 1]: requests of a step at ``width`` that accepted ``a`` drafts, exactly
    as the hazards say (REQUESTS_PER_HIST requests)."""
    hist = torch.zeros(GAMMA + 1, dtype=torch.float64)
    alive = REQUESTS_PER_HIST
    for a in range(width - 1):
        hist[a] = alive * (1.0 - hazards[a])
        alive *= hazards[a]
    hist[width - 1] = alive
    return hist


def decide(rate, hazards: tuple[float, ...], bs: int) -> tuple[int, dict[int, float]]:
    """Width a fresh, measured policy picks at ``bs`` and its scores (expected tokens/s)."""
    policy = WidthPolicy(WidthPolicyConfig(gamma=GAMMA, widths=WIDTHS, histogram_lag=0), rate)
    policy.observe(GAMMA + 1, histogram(hazards, GAMMA + 1))
    first = policy.choose(bs)
    assert first == GAMMA + 1, f"step 0 is a refresh step, got width {first}"
    return policy.choose(bs), policy.scores(bs)


def rate_model(table: SpsTable) -> tuple[object, int, str]:
    """(rate model, largest bs it covers, what it is)."""
    tiers = table.metadata.tiers
    if not tiers:
        return table, MAX_BS, "SpsTable as is (no tiers in its metadata: floored lookup)"
    tier_objs = tuple(Tier(t, r) for t, r in tiers)
    top = min(MAX_BS, max(r for _, r in tiers))
    return TierRate(table, tier_objs, top), top, \
        "TierRate (dspark_compile.runtime): the table's rate at the tier a step replays"


def sweep(table: SpsTable) -> dict:
    """Decisions of every profile at bs = 1..max."""
    rate, top, how = rate_model(table)
    batch_sizes = list(range(1, top + 1))
    profiles = {}
    for name, hazards in PROFILES.items():
        widths, relative = [], []
        for bs in batch_sizes:
            w, scores = decide(rate, hazards, bs)
            widths.append(w)
            relative.append(round(scores[w] / scores[GAMMA + 1], 4))
        e = expected_tokens(torch.tensor(hazards)).tolist()
        profiles[name] = dict(hazards=list(hazards), expected_tokens_by_width=[round(x, 4)
                              for x in e], width=widths, relative_tokens_per_s=relative)
    return dict(rate_model=how, batch_sizes=batch_sizes, profiles=profiles)


def plot(label: str, table: SpsTable, result: dict, path: Path, synthetic: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7.5), sharex=True)
    bs = result["batch_sizes"]
    pow2 = [b for b in bs if b & (b - 1) == 0]  # request counts with an exact tier
    for i, (name, p) in enumerate(result["profiles"].items()):
        shifted = [w + 0.05 * (i - 2) for w in p["width"]]  # lines would hide each other
        line, = top.step(bs, shifted, where="mid", lw=1, label=name)
        top.plot(pow2, [shifted[b - 1] for b in pow2], "o", ms=4, color=line.get_color())
        bottom.plot(bs, p["relative_tokens_per_s"], lw=1, label=name)
    if synthetic:
        top.scatter(list(MI355X_BEST), list(MI355X_BEST.values()), marker="x", s=60, color="k",
                    zorder=5, label="MI355X sweep best width")
    top.set_ylabel("width picked (tokens / request)")
    top.set_yticks(range(1, GAMMA + 2))
    kind = "SYNTHETIC table" if synthetic else "measured table"
    top.set_title(f"WidthPolicy width vs bs, {kind} '{label}'\n{table.metadata.gpu}; "
                  f"{table.metadata.model}\n(dots: bs with an exact tier; between them a step "
                  "pads to the next tier)", fontsize=8)
    top.legend(fontsize=7)
    bottom.axhline(1.0, color="gray", lw=0.8)
    bottom.set_ylabel("expected tokens/s vs full width")
    bottom.set_xlabel("batch size (requests)")
    bottom.set_xscale("log", base=2)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_table(label: str, table: SpsTable, source: str, out: Path, synthetic: bool) -> dict:
    result = sweep(table)
    plot(label, table, result, out / f"width_decisions_{label}.png", synthetic)
    plot_sps(table, str(out / f"sps_curve_{label}.png"))
    pow2 = [bs for bs in result["batch_sizes"] if bs & (bs - 1) == 0]
    picked = {"bs": pow2, **{name: [p["width"][bs - 1] for bs in pow2]
                             for name, p in result["profiles"].items()}}
    report = dict(benchmark="width_decisions", label=label, synthetic=synthetic,
                  table=dict(source=source, gpu=table.metadata.gpu, model=table.metadata.model,
                             versions=dict(table.metadata.versions),
                             tiers=len(table.metadata.tiers), points=len(table.entries)),
                  policy=f"WidthPolicyConfig(gamma={GAMMA}, widths={WIDTHS}, histogram_lag=0), "
                         "default decay/switch_margin/refresh_every; a fresh policy per bs, one "
                         f"full-width histogram of {REQUESTS_PER_HIST:.0f} requests observed",
                  command=" ".join(["python", *sys.argv]),
                  width_at_powers_of_two=picked, **result)
    text = json.dumps(report, indent=1)  # below: one line per list of numbers
    text = re.sub(r"\[\s+([-\d.,\s]+?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    (out / f"width_decisions_{label}.json").write_text(text + "\n")
    return report


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, action="append", default=[],
                    help=f"SPS table JSON (repeatable); default {DEFAULT_TABLE} if it exists")
    ap.add_argument("--synthetic-only", action="store_true", help="only the synthetic table")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    opts = ap.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    tables = [] if opts.synthetic_only else opts.table or (
        [DEFAULT_TABLE] if DEFAULT_TABLE.exists() else [])
    reports = {"synthetic": run_table("synthetic", synthetic_table(),
                                      "synthetic_table() in benchmarks/width_decisions.py",
                                      opts.out, True)}
    for path in tables:
        reports[path.stem] = run_table(path.stem, SpsTable.load(path), str(path), opts.out, False)
    for label, rep in reports.items():
        print(f"{label}: width picked")
        for name, widths in rep["width_at_powers_of_two"].items():
            print(f"  {name:>34}: {widths}")
        print(f"  wrote {opts.out}/width_decisions_{label}.png, .json, sps_curve_{label}.png")
    return reports


if __name__ == "__main__":
    main()
