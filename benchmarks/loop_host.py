"""Host time of one engine-loop step of e2e.py outside the model forward, per piece and mode.

The e2e loop (``e2e.Decoder._step``) is host-synchronous: everything it does on the host adds
to every step. This times that host work on the CPU with e2e's own code, at R = 1, 8, 64, 256
requests, gamma 7, for the static full block, the compact planner and the width policy:

- ``plan``: ``Decoder._lens`` (the planner: one ``Planner``'s ``lengths`` with
  ``PlannerConfig(tiers=...)``, quiet steps included, and a ``TierRate`` over
  ``tier_set(256, 8)``; static: a constant array; width:
  ``WidthPolicy.choose`` over the same rate, every width 1..8 captured),
- ``pack``: ``Decoder._pack`` (``VerifyLayout.pack`` and the packed token ids),
- ``verify``: ``Verifier.__call__`` with a replay that does nothing (input and layout checks,
  the tier lookup, the static-buffer fill); ``check_layout`` and ``fill`` are timed again
  alone, as parts of it,
- ``commit``: ``Verifier.commit`` (checks and the committed-length bookkeeping),
- ``emit``: ``Decoder._emit`` (accepted tokens into the token table, counts, statistics),
- ``observe``: the width policy's ``observe`` of the step's acceptance histogram, as e2e.py
  feeds it (nothing in the other modes).

Not timed: drafting (a table lookup, subtracted in e2e.py too), the forward (no graph is
replayed) and the accept kernel with its copy to the host (stubbed with the drafter's truth).
Confidences come from e2e's synthetic drafter (Beta, mean 3 of 7 accepted, concentration 2);
the rate is a synthetic request-keyed table, ``ms = 1.6 + 0.0085 B + 0.0075 R`` (within 20% of
DESIGN.md's H200 figures at bs 1 / 64 / 256), plus e2e's measured 0.8 ms loop overhead.
Modes, sizes and pieces are interleaved in rounds (the 2-core VM this was written on has slow
phases of tens of seconds); the median over every call is reported.

    python benchmarks/loop_host.py [--rounds N] [--steps N] [--out DIR]

Writes ``loop_host.json`` (machine, versions, settings, median us per piece, mode and R).
To compare two checkouts, alternate whole runs of each (a slow phase then hits both): six
alternated runs (--rounds 30) on the 2-core Xeon, median of the runs' medians, step us at
R = 1 / 8 / 64 / 256, static: 217 / 231 / 251 / 316 at 68aff4a (this script's first commit)
-> 115 / 118 / 126 / 159 at 294d5b2; planner: 319 / 326 / 362 / 462 -> 154 / 167 / 192 / 264,
of which planning 88 / 85 / 98 / 134 -> 37 / 42 / 52 / 82.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch

import e2e
from common import build_model, cpu_name, write_json
from dspark_compile import dspark_compile
from dspark_compile.engine.drafter import SyntheticDrafter
from dspark_compile.session import TierGraphs, VerifySession
from dspark_compile.session.tiers import tier_set
from dspark_compile.runtime import (Planner, SpsEntry, SpsMetadata, SpsTable, TierRate, WidthPolicy,
                                    WidthPolicyConfig)

GAMMA = 7
REQUESTS = (1, 8, 64, 256)
MODES = ("static", "planner", "width")
PIECES = ("plan", "pack", "verify", "commit", "emit", "observe")
PARTS = ("check_layout", "fill")
CONTEXT = 1024
OVERHEAD_S = 0.8e-3
"""e2e.py's loop time per step outside the replay at c = 64 on the H200 (~0.77-0.95 ms)."""
REFERENCE_LEN = 320


class _NoReplay:
    """Stands in for a captured tier graph: the host path of a replay, without the forward."""

    def replay(self) -> None:
        pass


def synthetic_table(tiers) -> SpsTable:
    """Request-keyed SPS at every tier: ``ms = 1.6 + 0.0085 B + 0.0075 R`` (see the docstring)."""
    points = sorted({(t.request_slots, t.tokens) for t in tiers})
    return SpsTable(SpsMetadata("synthetic (H200-like)", "1.1B Llama-like"), tuple(
        SpsEntry(b, 1e3 / (1.6 + 0.0085 * b + 0.0075 * r), r) for r, b in points))


def build(max_requests: int):
    """A decoder of e2e.py over a tiny verifier whose tier graphs replay nothing."""
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=64)
    model = build_model(tiny, device="cpu", dtype=torch.float32)
    verifier = dspark_compile(model, lowering="reference", block=GAMMA + 1)
    state = verifier.new_state(max_requests=max_requests,
                               max_context=CONTEXT + REFERENCE_LEN + 2 * (GAMMA + 1))
    tiers = tier_set(max_requests, GAMMA + 1)
    graphs = TierGraphs(lambda *a: None, tiers, tiny["vocab_size"], torch.float32,
                        torch.device("cpu"), use_graphs=False)
    graphs.graphs = {t: _NoReplay() for t in tiers}
    verifier._sessions[state] = VerifySession(verifier, state, graphs, [])  # no capture
    table = synthetic_table(tiers)
    s = replace(e2e.SMOKE, model=tiny, context=CONTEXT, gamma=GAMMA,
                concurrency=(max_requests,))
    decoder = e2e.Decoder(verifier, state, s, table, tiers)
    decoder.rate = TierRate(table, tiers, max_requests, OVERHEAD_S)
    return decoder


class Case:
    """One (mode, R): its requests, drafter, token table and the state it resets to."""

    def __init__(self, decoder, mode: str, r: int, seed: int) -> None:
        self.decoder, self.mode, self.r = decoder, mode, r
        rng = np.random.default_rng(seed)
        self.reference = rng.integers(0, decoder.vocab, (r, REFERENCE_LEN))
        self.drafter = SyntheticDrafter(self.reference, GAMMA, 3.0, 2.0, decoder.vocab, seed)
        self.rids = np.arange(r)
        self.run = e2e.Run(np.zeros((r, REFERENCE_LEN + GAMMA + 2), np.int64))
        self.step = 0
        self.policy = WidthPolicy(WidthPolicyConfig(GAMMA, tuple(range(1, GAMMA + 2))),
                                  decoder.rate) if mode == "width" else \
            Planner(decoder.rate, decoder.planner) if mode == "planner" else None

    def time_step(self, times: dict[str, list[float]]) -> None:
        """One step, each piece timed alone; appends microseconds to ``times[piece]``."""
        d, r, rids, run = self.decoder, self.r, self.rids, self.run
        e = np.full(r, 1 + self.step % (REFERENCE_LEN - 2 * GAMMA - 2), np.int64)  # [R]
        self.step += 1
        counts = np.zeros(r, np.int64)
        counts[rids] = e
        run.tokens[rids, e - 1] = self.reference[rids, e - 1]
        d.state.committed_lens[:r] = torch.from_numpy((CONTEXT + e - 1).astype(np.int32))
        drafts, conf = self.drafter.draft(rids, e)
        lens = _timed(times, "plan", d._lens, self.mode, conf, r, self.policy)
        layout, ids = _timed(times, "pack", d._pack, rids, e, lens, drafts, run.tokens)
        _timed(times, "verify", d.verifier, ids, layout, d.state)
        _timed(times, "check_layout", d.state.check_layout, layout, ids.numel())
        tier = d.verifier.session(d.state).graphs._tier_of[(layout.num_tokens, r)]
        _timed(times, "fill", d.verifier.session(d.state).graphs.fill, tier, ids, layout)
        acc, nxt = self.accept(drafts, e, lens)
        _timed(times, "commit", d.verifier.commit, layout, acc + 1, d.state)
        _timed(times, "emit", d._emit, rids, e, layout, drafts, acc, nxt, counts, run)
        _timed(times, "observe", self.observe, lens, acc)

    def observe(self, lens: np.ndarray, acc: np.ndarray) -> None:
        """The width policy's read of the step's acceptance histogram, as e2e.py feeds it."""
        if self.mode == "width":
            self.policy.observe(int(lens[0]), torch.from_numpy(np.bincount(acc,
                                                                           minlength=GAMMA + 1)))

    def accept(self, drafts: np.ndarray, e: np.ndarray, lens: np.ndarray):
        """What the greedy accept kernel would return: the drafts that match the reference, up
        to each request's verify length, and the reference token after them."""
        right = drafts == self.reference[self.rids[:, None], e[:, None] + np.arange(GAMMA)]
        acc = np.minimum(np.cumprod(right, axis=1).sum(axis=1), lens - 1).astype(np.int64)
        return acc, self.reference[self.rids, e + acc]


def _timed(times: dict[str, list[float]], piece: str, fn, *args):
    start = time.perf_counter_ns()
    out = fn(*args)
    times[piece].append((time.perf_counter_ns() - start) / 1e3)
    return out


def measure(rounds: int, steps: int) -> dict:
    decoder = build(max(REQUESTS))
    cases = {(m, r): Case(decoder, m, r, seed=r) for m in MODES for r in REQUESTS}
    times = {key: {p: [] for p in PIECES + PARTS} for key in cases}
    for case in cases.values():  # warm-up: tier lookups, first-call paths
        for _ in range(50):
            case.time_step({p: [] for p in PIECES + PARTS})
    for _ in range(rounds):
        for key, case in cases.items():
            for _ in range(steps):
                case.time_step(times[key])
    out = {}
    for (mode, r), t in times.items():
        row = {f"{p}_us": round(statistics.median(t[p]), 1) for p in PIECES + PARTS}
        per_step = [sum(t[p][i] for p in PIECES) for i in range(len(t["plan"]))]
        row["step_us"] = round(statistics.median(per_step), 1)
        out.setdefault(mode, {})[str(r)] = row
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case per round")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as e2e.py's CPU runs; small host ops gain nothing from more
    results = measure(args.rounds, args.steps)
    for mode, rows in results.items():
        for r, row in rows.items():
            print(f"{mode:>8} R={r:>3}: " + "  ".join(
                f"{k.removesuffix('_us')} {v:6.1f}" for k, v in row.items()), flush=True)
    env = {"cpu": cpu_name(), "logical_cores": os.cpu_count(), "python": platform.python_version(),
           "torch": torch.__version__, "numpy": np.__version__,
           "command": "python benchmarks/loop_host.py " + " ".join(argv or sys.argv[1:]),
           "load_average_1min": os.getloadavg()[0]}
    data = {"environment": env, "settings": {
        "gamma": GAMMA, "requests": list(REQUESTS), "modes": list(MODES),
        "rounds": args.rounds, "steps_per_round": args.steps, "context": CONTEXT,
        "step_overhead_s": OVERHEAD_S, "table": "ms = 1.6 + 0.0085 B + 0.0075 R per tier",
        "drafter": "SyntheticDrafter(mean_accepted=3, concentration=2)"},
        "pieces": "median us per call; step = median of the per-step sum of plan, pack, "
                  "verify, commit, emit, observe (check_layout and fill are parts of verify)",
        "results": results}
    write_json(args.out, "loop_host.json", data)
    return data


if __name__ == "__main__":
    main()
