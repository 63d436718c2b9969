"""End-to-end greedy speculative decoding: tokens/s of every verify mode, side by side.

Target: verify_step.py's Llama-like 1.1B (bf16, seed 0) with a *successor head* (below);
context 1024, 256 decoded tokens per request, gamma 7, concurrency 1, 8, 64, 256. Modes: no
speculation (every request verifies its anchor), the static full block (8), every fixed width
2..7 (the best one, chosen after the fact, is reported as "best fixed"), the per-step width
policy and the compact planner (ragged lengths from draft confidence). Both policies trade on an
SPS table that ``profile_sps`` measures first on the same verifier and state (it is in the JSON).

    python benchmarks/e2e.py            # full (H200, ~5 min)
    python benchmarks/e2e.py --quick    # bs 1 and 8, 64 tokens
    python benchmarks/e2e.py --smoke    # tiny random Llama on the CPU, bs 1 and 4, 16 tokens

What is timed (CUDA events around each whole run, after a warm-up run of the same mode): every
step's planning (width policy or planner, on the host), packing (layout, token ids), the
verify forward (tier-graph replay), the accept kernel, the copy of its result to the host, the
commit and the bookkeeping of emitted tokens. Drafting is *not* timed: the drafter below is a
table lookup, its host time is measured per step and subtracted (``draft_seconds`` in the JSON).
The prefill (one per concurrency, shared by every mode: a mode starts from the committed prompt)
is not timed either. tokens/s = requests x decoded tokens / (run time - draft time).

Drafter: synthetic and calibrated. Each request's greedy continuation is decoded first with no
speculation (the reference) by the package's own loop, ``ReferenceEngine`` in mode ``none``
(which also prefills the prompts); at emitted count ``e`` draft ``j`` is the reference token ``e + j``
with probability ``c`` and a wrong one otherwise, where the confidence ``c ~ Beta`` (mean ``mu``,
``alpha + beta = concentration``) is what the drafter reports. ``mu`` solves
``sum_{j=1..gamma} mu^j = mean_accepted`` (3.0: about 3 of 7 accepted). The draws are seeded
per concurrency and shared by every mode, so all modes see the same drafts in the same state.
Acceptance is decided by the target (greedy accept kernel), never by the draw.

Successor head: the random model's top two logits are often one bf16 step apart (one greedy
step in 20 within 0.016, some exactly tied), so batch geometries that sum in another order
would flip its greedy tokens and the drafts would stop matching the reference. The embeddings
are scaled by ``embed_scale`` and the LM head row of ``sigma(u)`` is the unit embedding of
``u`` (``sigma`` a seeded permutation), so the greedy successor wins by > 13 logits (measured
on CPU over 1280 tokens); every matmul and attention read is unchanged, so a step costs what
the 1.1B model's step costs. ``--target random`` keeps
the plain random model (used by the CPU test, where the float32 numerics agree).

Loops: the reference decode (prefill and plain greedy decoding) runs through
``dspark_compile.engine.ReferenceEngine`` on the captured state. The timed runs keep the
smallest piece of loop of their own, :class:`Decoder` (plan, pack, verify, accept, commit,
emit per step), because three things they measure cannot be had through ``ReferenceEngine``:
(1) tokens/s of a loop whose host work is vectorised over requests (NumPy token table, one
device-to-host copy per step), where the reference engine keeps per-request Python lists and
builds each step's rows with a Python loop over requests, host work that would be charged to
every verify mode alike; (2) every mode restarting from the same prefilled prompts (the engine
prefills on admission, so each timed run would include a prefill); (3) the split of a step's
time into drafting (subtracted), planning and verify GPU time, for which ``ReferenceEngine.step``
has no hooks. The accept step, commit and planners are the package's own in both loops.

Writes ``e2e[_quick|_smoke].json`` (GPU, versions, every setting, the SPS table, per
concurrency and mode: tokens/s, mean verify tokens per step, mean accepted, steps, mismatches
against the reference) and a PNG to --out (default: $OUT if set, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.config import GROUP_LINEARS, ROTARY
from dspark_compile.engine import EngineConfig, ReferenceEngine
from dspark_compile.engine.accept import (PreDrawnNoise, SamplingParams, accept,
                                          accept_reference)
from dspark_compile.engine.drafter import SyntheticDrafter
from dspark_compile.session.tiers import select_tier, tier_set
from dspark_compile.runtime import (Planner, PlannerConfig, TierRate, WidthPolicy,
                                    WidthPolicyConfig, plan_lengths)
from dspark_compile.runtime.profiler import profile_sps
from common import LLAMA_1B, build_model, variant_suffix, versions, write_json

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512)


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on; all of it is written to the JSON."""

    name: str
    """"full", "quick" or "smoke" (the JSON file's suffix)."""
    device: str
    """"cuda" (Triton lowering, Inductor, tier graphs) or "cpu" (reference ops, eager)."""
    model: dict
    """LlamaConfig arguments of the target."""
    dtype: str
    """Weights and logits dtype: "bfloat16" or "float32"."""
    context: int
    """Prompt tokens per request (random ids, prefilled once per concurrency)."""
    output: int
    """Tokens decoded per request after the prefill's first token (tokens/s counts these)."""
    concurrency: tuple[int, ...]
    """Requests decoded together, one run per value (all admitted at once, none queued)."""
    gamma: int = 7
    """Draft tokens per request per step (the full block is gamma + 1)."""
    target: str = "successor"
    """"successor" (greedy robust to summation order, see the docstring) or "random"."""
    embed_scale: float = 100.0
    """Embedding scale of the successor head (100: smallest greedy margin 13.8 logits)."""
    mean_accepted: float = 3.0
    """Design mean of drafts accepted per step out of gamma (sets the drafter's mu)."""
    concentration: float = 2.0
    """alpha + beta of the confidence Beta: lower is a more decisive confidence signal."""
    warmup_output: int = 16
    """Tokens per request of the untimed warm-up run before each timed run."""
    prefill_tokens: int = 16384
    """Packed tokens per prefill forward of the reference engine (requests are submitted to it
    in groups of ``prefill_tokens // context``; the logits of a group are [tokens, vocab])."""
    page_size: int = 16
    """KV page size in tokens."""
    sps_iters: int = 20
    """Timed steps per tier when profiling the SPS table (the median is kept). The H200 table
    from 5 was not monotone within a request tier (1 request: 623 steps/s at 2 tokens, 682 at
    8; noise or a real matmul cliff, not yet told apart); 20 steadies each median."""
    seed: int = 0
    """Seed of the weights, the prompts, the successor permutation and the drafter."""
    group_linears: str = "auto"
    """``DSparkConfig(group_linears=...)`` of the verifier (GPU runs)."""
    repeats: int = 3
    """Timed runs per mode (after every mode's warm-up), taken round the modes; the median run
    is reported, every run's tokens/s is kept. The host's share of a step varies run to run: one run per mode once gave
    fixed width 6 at c = 64 45129 and 56152 tok/s in two processes."""
    step_overhead: bool = True
    """Price steps for the width policy and the planner at ``1 / SPS + overhead``
    (``TierRate(step_overhead_s=...)``), the overhead being this loop's time per step outside
    the graph replay, measured on untimed no-speculation runs at the same concurrency ahead
    of the timed ones; False: the SPS table of graph replays alone."""
    rotary: str = "auto"
    """``DSparkConfig(rotary=...)`` of the verifier (GPU runs)."""


FULL = Settings("full", "cuda", LLAMA_1B, "bfloat16", 1024, 256, (1, 8, 64, 256))
QUICK = replace(FULL, name="quick", output=64, concurrency=(1, 8))
SMOKE = Settings("smoke", "cpu", TINY, "float32", 32, 16, (1, 4), warmup_output=4,
                 prefill_tokens=256, sps_iters=2)


def mode_names(gamma: int) -> tuple[str, ...]:
    """Every mode a concurrency runs, in order."""
    return ("none", "static", *(f"fixed_{w}" for w in range(2, gamma + 1)), "width", "planner")


# ---------------------------------------------------------------------- target
def build_target(s: Settings):
    """The target model and its successor permutation (None for ``target="random"``)."""
    if s.target not in ("successor", "random"):
        raise ValueError(f"Settings.target={s.target!r}; it must be 'successor' or 'random'")
    # the weights of verify_step.py's model at seed 0
    model = build_model(s.model, s.device, getattr(torch, s.dtype), s.seed)
    if s.target == "random":
        return model, None
    emb = model.model.embed_tokens.weight
    if model.lm_head.weight.data_ptr() == emb.data_ptr():
        raise ValueError("build_target: the LM head is tied to the embeddings; the successor "
                         "head needs its own weight (tie_word_embeddings=False)")
    perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(s.seed + 1))
    with torch.no_grad():
        unit = emb.float() / emb.float().norm(dim=1, keepdim=True)  # [V, H]
        head = torch.empty_like(unit)
        head[perm.to(unit.device)] = unit  # row sigma(u) reads u's direction
        model.lm_head.weight.copy_(head)
        emb.mul_(s.embed_scale)  # the current token dominates the residual stream
    return model, perm


# ---------------------------------------------------------------------- decoding loop
def start_clock(device: torch.device):
    """Start timing a whole run; the returned function gives (seconds, host seconds): CUDA
    events on a GPU (the loop syncs every step, so both agree within a launch), the host clock
    on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
    host0 = time.perf_counter()

    def stop() -> tuple[float, float]:
        if device.type != "cuda":
            return (time.perf_counter() - host0,) * 2
        events[1].record()
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3, time.perf_counter() - host0
    return stop


@dataclass
class Run:
    """One decoding run: the token table and what its steps did."""

    tokens: np.ndarray
    """int64 [c, width]: emitted tokens per request, the prefill's first one at column 0 (columns
    at or past a request's count are scratch)."""
    steps: int = 0
    verify_tokens: int = 0
    """Sum over steps of the packed tokens verified (sum of lens)."""
    request_steps: int = 0
    accepted: int = 0
    draft_seconds: float = 0.0
    seconds: float = 0.0
    host_seconds: float = 0.0
    plan_seconds: float = 0.0
    """Host time choosing the lengths (planner, width policy; ~0 for a fixed width)."""
    verify_gpu_seconds: float = 0.0
    """Sum over steps of the verify call's GPU time (CUDA events around it; 0 on the CPU):
    the rest of ``seconds`` is host work and the accept/commit kernels."""
    shapes: list = field(default_factory=list)
    """(tokens, requests) of every step, to find the tier each replayed."""


class _OnState:
    """``verifier`` with ``new_state`` handing back ``state``: lets ``ReferenceEngine`` (which
    allocates its state through the verifier) run on the state whose tier graphs were captured
    and whose slots the timed runs reuse."""

    def __init__(self, verifier, state) -> None:
        self._verifier, self._state = verifier, state

    def new_state(self, max_requests: int, max_context: int, window_rings: bool = False):
        if window_rings != self._state.compact:
            raise ValueError(f"_OnState: the engine wants window_rings={window_rings}; the "
                             f"state was made with{'' if self._state.compact else 'out'} them")
        if max_requests > self._state.max_requests:
            raise ValueError(f"_OnState: the engine wants {max_requests} slots; the state has "
                             f"{self._state.max_requests}")
        return self._state

    def __call__(self, *args, **kwargs):
        return self._verifier(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._verifier, name)


def reference_decode(verifier, state, prompts: torch.Tensor, tokens: int, s: Settings):
    """Prefill ``prompts [c, context]`` into slots ``0..c-1`` of ``state`` and decode
    ``tokens`` greedy tokens per request (the prefill's first one included) with the package's
    reference engine in mode ``none``; int64 ``[c, tokens]``.

    Requests are submitted in groups of ``prefill_tokens // context``, one group per engine
    step, so no prefill forward packs more than ``prefill_tokens`` rows (a group past the
    largest tier runs without a graph). Afterwards every slot is released (committed length 0)
    with its prompt's KV still in its pages: :meth:`Decoder.run` restarts from there."""
    c, ctx = prompts.shape
    state.release(list(range(c)))  # what the timed runs of the last concurrency left there
    max_context = ctx + s.output + 2 * (s.gamma + 1)
    engine = ReferenceEngine(_OnState(verifier, state), None,  # mode none drafts nothing
                             EngineConfig(mode="none", gamma=s.gamma, max_context=max_context),
                             max_requests=c)
    per = max(1, s.prefill_tokens // ctx)
    for lo in range(0, c, per):
        for prompt in prompts[lo:lo + per]:
            engine.submit(prompt, tokens)
        engine.step()  # admits (prefills) this group, then one step of every running request
    if any(r.slot != r.rid for r in engine.running):
        raise RuntimeError("reference_decode: a request is not in the slot of its index; the "
                           "timed runs read prompt i's KV from slot i")
    out = engine.run()
    return np.array([out[i] for i in range(c)], dtype=np.int64)


class Decoder:
    """Greedy speculative decoding of a fixed batch in slots ``0..c-1`` of one state: the timed
    loop (the module docstring says why it is not ``ReferenceEngine``'s).

    Per-request state lives in NumPy arrays (no Python loop over requests), so the host work of
    a step is what a serving engine would do, not the reference engine's per-request
    bookkeeping.
    """

    def __init__(self, verifier, state, s: Settings, table, tiers) -> None:
        self.verifier, self.state, self.s, self.table, self.tiers = \
            verifier, state, s, table, tiers
        self.replay_rate = TierRate(table, tiers, state.max_requests)
        """Steps priced by the SPS table of graph replays alone."""
        self.rate = self.replay_rate
        """What the width policy and the planner price steps with (``bench_concurrency`` adds
        the loop's overhead per concurrency)."""
        self.dev = verifier.device
        self.vocab = s.model["vocab_size"]
        self.planner = PlannerConfig(tiers=tuple((t.tokens, t.request_slots) for t in tiers))
        rows = state.max_requests
        self._uniforms = torch.zeros(rows * (s.gamma + 1), device=self.dev)  # unused by greedy
        self._gumbel = torch.zeros(rows, self.vocab, device=self.dev)
        self._sampling: dict[int, SamplingParams] = {}
        self._accept = accept if self.dev.type == "cuda" else accept_reference
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] \
            if self.dev.type == "cuda" else None
        self._positions = np.arange(s.gamma + 1)  # [g + 1]: a request's rows in a step

    def warm_accept(self, c: int) -> None:
        """Run the accept step once at every request count ``1..c``: the Triton kernels
        specialise on it (a lookup width, ``r == 1``, ``r % 16``), and a compile inside a
        timed run would cost more than the run."""
        for r in range(1, c + 1):
            logits = torch.zeros(r, self.vocab, dtype=self.verifier.dtype, device=self.dev)
            ids = torch.zeros(r, dtype=torch.int64, device=self.dev)
            self._accept_step(logits, ids, VerifyLayout.pack([1] * r, [0] * r, list(range(r))))

    def _accept_step(self, logits, ids, layout) -> tuple[np.ndarray, np.ndarray]:
        """Greedy accept; (accepted drafts [R], next token [R]) on the host (one copy)."""
        n, r = layout.num_tokens, layout.num_requests
        if r not in self._sampling:
            self._sampling[r] = SamplingParams.build(0.0, num_requests=r, device=self.dev)
        noise = PreDrawnNoise(self._uniforms[:n], self._gumbel[:r])
        res = self._accept(logits, ids, layout.query_start_loc.to(self.dev), self._sampling[r],
                           noise)
        out = torch.stack([res.num_accepted_drafts.to(torch.int64), res.next_tokens]).cpu()
        return out[0].numpy(), out[1].numpy()

    def run(self, mode: str, first: np.ndarray, drafter, output: int) -> Run:
        """Decode ``output`` tokens per request after ``first`` in ``mode``; timed."""
        c, g = first.size, self.s.gamma
        run = Run(np.zeros((c, output + g + 2), np.int64))
        run.tokens[:, 0] = first
        counts = np.ones(c, np.int64)  # tokens emitted per request; the last one is the anchor
        self.state.committed_lens[:c] = self.s.context  # back to the prefilled prompt
        policy = WidthPolicy(WidthPolicyConfig(g, tuple(range(1, g + 2))), self.rate) \
            if mode == "width" else Planner(self.rate, self.planner) if mode == "planner" \
            else None
        stop = start_clock(self.dev)
        while (rids := np.flatnonzero(counts < 1 + output)).size:
            self._step(mode, rids, counts, drafter, policy, run)
        run.seconds, run.host_seconds = stop()
        return run

    def _lens(self, mode: str, conf, r: int, policy) -> np.ndarray:
        g = self.s.gamma
        if mode == "planner":
            return policy.lengths(conf)  # NumPy in and out; the Planner's state
        width = {"none": 1, "static": g + 1}.get(mode) or \
            (policy.choose(r) if mode == "width" else int(mode.removeprefix("fixed_")))
        return np.full(r, width, np.int32)

    def _step(self, mode: str, rids: np.ndarray, counts: np.ndarray, drafter, policy,
              run: Run) -> None:
        """Draft, plan, verify, accept, commit and emit for the running requests ``rids``."""
        g, e = self.s.gamma, counts[rids]
        drafts, conf = np.zeros((rids.size, g), np.int64), None
        if mode != "none":
            t0 = time.perf_counter()
            drafts, conf = drafter.draft(rids, e)
            run.draft_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        lens = self._lens(mode, conf, rids.size, policy)  # int32 [R]
        run.plan_seconds += time.perf_counter() - t0
        layout, ids = self._pack(rids, e, lens, drafts, run.tokens)
        if self._events:
            self._events[0].record()
        logits = self.verifier(ids, layout, self.state)
        if self._events:
            self._events[1].record()
        acc, nxt = self._accept_step(logits, ids, layout)  # waits for the step: events are done
        if self._events:
            run.verify_gpu_seconds += self._events[0].elapsed_time(self._events[1]) / 1e3
        self.verifier.commit(layout, acc + 1, self.state)  # int64 NumPy, taken as it is
        self._emit(rids, e, layout, drafts, acc, nxt, counts, run)
        if mode == "width":
            t0 = time.perf_counter()
            policy.observe(int(lens[0]), torch.from_numpy(np.bincount(acc, minlength=g + 1)))
            run.plan_seconds += time.perf_counter() - t0

    def _pack(self, rids: np.ndarray, e: np.ndarray, lens: np.ndarray, drafts: np.ndarray,
              tokens: np.ndarray) -> tuple[VerifyLayout, torch.Tensor]:
        """The step's layout and packed token ids ``[N]`` on the device: each request's anchor
        (its last emitted token) and its first ``lens - 1`` drafts.

        NumPy in, one tensor out: ``VerifyLayout.pack`` takes int32 arrays as they are, and a
        full block (every request ``gamma + 1`` tokens) is the block itself, no mask."""
        g, r = self.s.gamma, rids.size
        block = np.empty((r, g + 1), np.int64)  # [R, g + 1]
        block[:, 0] = tokens[rids, e - 1]
        block[:, 1:] = drafts
        layout = VerifyLayout.pack(lens, np.add(e, self.s.context - 1, dtype=np.int32),
                                   rids.astype(np.int32))
        flat = block.reshape(-1) if layout.num_tokens == r * (g + 1) else \
            block[self._positions < lens[:, None]]  # [N]
        return layout, torch.from_numpy(flat).to(self.dev)

    def _emit(self, rids: np.ndarray, e: np.ndarray, layout: VerifyLayout, drafts: np.ndarray,
              acc: np.ndarray, nxt: np.ndarray, counts: np.ndarray, run: Run) -> None:
        """Write each request's accepted drafts and next token into ``run.tokens``, advance
        ``counts`` and the run's statistics.

        All ``gamma`` drafts go to columns ``e .. e + gamma - 1`` and the next token to
        ``e + acc`` after them: the columns past it are at or beyond the request's new count,
        scratch that its next step overwrites before reading (only column ``count - 1``, the
        anchor, is read), so no mask of the accepted ones is built."""
        tokens, n = run.tokens, layout.num_tokens
        tokens[rids[:, None], e[:, None] + self._positions[:-1]] = drafts  # [R, g]
        tokens[rids, e + acc] = nxt
        counts[rids] += acc + 1
        run.steps += 1
        run.verify_tokens += n
        run.request_steps += rids.size
        run.accepted += int(acc.sum())
        run.shapes.append((n, rids.size))


# ---------------------------------------------------------------------- one concurrency
def rank_cost_s(decoder: Decoder, first: np.ndarray, drafter, c: int,
                output: int = 64, calls: int = 31) -> float:
    """Host seconds a ranked step costs the loop beyond the full block, for the planner's
    ``PlannerConfig.rank_cost_s``: the planning time per step of an untimed planner run of
    ``output`` tokens that ranks every step (the flat rule off; the loop's own arrays, so the
    cache misses of a real step are in it, which a ranking of one array timed in a tight loop
    leaves out: docs/benchmarks.md), plus what packing ragged lengths takes beyond packing
    the full block (medians of ``calls``). The verifier's own host work is not in it."""
    base = decoder.planner
    decoder.planner = replace(base, flat_tolerance=None, rank_cost_s=0.0, quiet_steps=0)
    try:
        run = decoder.run("planner", first, drafter, output)
    finally:
        decoder.planner = base
    rids, e = np.arange(c), np.ones(c, np.int64)
    drafts, conf = drafter.draft(rids, e)
    lens = plan_lengths(conf, decoder.rate, replace(base, flat_tolerance=None, rank_cost_s=0.0,
                                                    quiet_steps=0))
    tokens = np.zeros((c, decoder.s.gamma + 2), np.int64)
    full = np.full(c, decoder.s.gamma + 1, np.int32)

    def median_s(fn) -> float:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    pack_ragged = median_s(lambda: decoder._pack(rids, e, lens, drafts, tokens))
    pack_full = median_s(lambda: decoder._pack(rids, e, full, drafts, tokens))
    return run.plan_seconds / max(1, run.steps) + max(0.0, pack_ragged - pack_full)


def summarize(run: Run, got: np.ndarray, want: np.ndarray, tiers) -> dict:
    """The JSON row of one timed run (``got``/``want``: decoded tokens [c, output])."""
    tier_tokens = sum(select_tier(tiers, n, r).tokens for n, r in run.shapes)
    timed = run.seconds - run.draft_seconds
    return {"tokens_per_s": got.size / timed, "mean_verify_tokens_per_step":
            run.verify_tokens / run.steps, "mean_tier_tokens_per_step": tier_tokens / run.steps,
            "mean_verify_len_per_request": run.verify_tokens / run.request_steps,
            "mean_accepted": run.accepted / run.request_steps, "steps": run.steps,
            "seconds": run.seconds, "host_seconds": run.host_seconds,
            "draft_seconds": run.draft_seconds, "plan_ms_per_step":
            1e3 * run.plan_seconds / run.steps, "verify_gpu_ms_per_step":
            1e3 * run.verify_gpu_seconds / run.steps, "decoded_tokens": int(got.size),
            "mismatched_tokens": int((got != want).sum()),
            "output_sha1": hashlib.sha1(np.ascontiguousarray(got).tobytes()).hexdigest()}


def bench_concurrency(decoder: Decoder, prompts: torch.Tensor, s: Settings):
    """Prefill, decode the reference, then warm up and time every mode; (rows, outputs)."""
    out = s.output
    reference = reference_decode(decoder.verifier, decoder.state, prompts, 1 + out + s.gamma, s)
    first = reference[:, 0]
    drafter = SyntheticDrafter(reference, s.gamma, s.mean_accepted, s.concentration,
                               decoder.vocab, s.seed + prompts.shape[0])
    decoder.warm_accept(prompts.shape[0])
    rows, outputs = {}, {"reference": reference[:, 1:1 + out]}
    c = prompts.shape[0]
    decoder.rate = decoder.replay_rate
    overhead, probe, steps = 0.0, [], 0
    if s.step_overhead:  # c tokens over c requests every step: the loop's time outside a replay
        decoder.run("none", first, drafter, s.warmup_output)
        probe = sorted(decoder.run("none", first, drafter, out).seconds
                       for _ in range(s.repeats))
        steps = out  # mode none emits one token per request per step
        replay_s = 1.0 / float(decoder.replay_rate.steps_per_second(torch.tensor([c]), c)[0])
        overhead = min(max(0.0, probe[len(probe) // 2] / steps - replay_s), 0.5)
        decoder.rate = TierRate(decoder.table, decoder.tiers, decoder.state.max_requests,
                                overhead)
    rank_cost = rank_cost_s(decoder, first, drafter, c, min(64, out))
    decoder.planner = replace(decoder.planner, rank_cost_s=rank_cost)
    modes = mode_names(s.gamma)
    for mode in modes:
        decoder.run(mode, first, drafter, s.warmup_output)
    # repeats go round the modes, so a drift of the machine over the minutes of a concurrency
    # (clocks, host) falls on every mode alike instead of on the modes timed last
    timed = {mode: [] for mode in modes}
    for _ in range(s.repeats):
        for mode in modes:
            timed[mode].append(decoder.run(mode, first, drafter, out))
    for mode in modes:
        rounds = timed[mode]  # in the order the rounds ran
        summaries = [summarize(r, r.tokens[:, 1:1 + out], outputs["reference"], decoder.tiers)
                     for r in rounds]
        ranked = sorted(range(len(rounds)),
                        key=lambda i: rounds[i].seconds - rounds[i].draft_seconds)
        mid = ranked[len(ranked) // 2]  # the median run
        outputs[mode] = rounds[mid].tokens[:, 1:1 + out]
        rows[mode] = {**summaries[mid],
                      "tokens_per_s_runs": [summaries[i]["tokens_per_s"] for i in ranked],
                      "tokens_per_s_rounds": [x["tokens_per_s"] for x in summaries],
                      "mismatched_tokens": max(x["mismatched_tokens"] for x in summaries)}
        print(f"  c={prompts.shape[0]:>3} {mode:>8}: {rows[mode]['tokens_per_s']:10.1f} tok/s, "
              f"{rows[mode]['mean_verify_tokens_per_step']:7.1f} verify tokens/step, "
              f"accepted {rows[mode]['mean_accepted']:.2f}, "
              f"mismatches {rows[mode]['mismatched_tokens']}", flush=True)
    fixed = [m for m in rows if m.startswith("fixed_")] + ["static"]
    best = max(fixed, key=lambda m: rows[m]["tokens_per_s"])
    return {"modes": rows, "best_fixed": best, "drafter_mu": drafter.mu,
            "step_overhead_ms": 1e3 * overhead, "rank_cost_ms": 1e3 * rank_cost,
            "overhead_probe_seconds": probe,
            "overhead_probe_steps": steps}, outputs


def targets(c: int, row: dict) -> dict:
    """The issue's targets: planner >= 1.0x no speculation at every concurrency, and >= the
    best fixed width (an after-the-fact pick, so an oracle) from 64 requests up. Besides the
    ratio of median runs, ``planner_over_best_fixed_paired``: the median over rounds of the
    planner's run over the best fixed width's run of the same round (a round runs every mode
    once, so a slow phase of the host falls on both runs of a pair)."""
    tps = {m: v["tokens_per_s"] for m, v in row["modes"].items()}
    vs_none, vs_fixed = tps["planner"] / tps["none"], tps["planner"] / tps[row["best_fixed"]]
    pairs = zip(row["modes"]["planner"]["tokens_per_s_rounds"],
                row["modes"][row["best_fixed"]]["tokens_per_s_rounds"])
    paired = float(np.median([p / f for p, f in pairs]))
    return {"planner_over_none": vs_none, "planner_over_best_fixed": vs_fixed,
            "planner_over_best_fixed_paired": paired,
            "meets_none": vs_none >= 1.0, "meets_best_fixed": vs_fixed >= 1.0 if c >= 64 else None}


def markdown_table(results: dict) -> str:
    """tokens/s (mean verify tokens per step) per mode and concurrency, and the planner's
    ratios."""
    head = ["c", "no spec", "static 8", "best fixed", "width policy", "planner",
            "planner / no spec", "planner / best fixed", "paired by round"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c, row in results.items():
        m, best = row["modes"], row["best_fixed"]

        def cell(k: str) -> str:
            return f"{m[k]['tokens_per_s']:.0f} ({m[k]['mean_verify_tokens_per_step']:.1f})"
        width = "8" if best == "static" else best.removeprefix("fixed_")
        ratios = row["targets"]
        lines.append(f"| {c} | {cell('none')} | {cell('static')} | w={width}: {cell(best)} | "
                     f"{cell('width')} | {cell('planner')} | {ratios['planner_over_none']:.2f}x "
                     f"| {ratios['planner_over_best_fixed']:.2f}x "
                     f"| {ratios['planner_over_best_fixed_paired']:.2f}x |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the whole run
def build_verifier(s: Settings):
    """Target, verifier, state with tier graphs and the SPS table measured on them."""
    model, perm = build_target(s)
    kwargs = dict(lowering="triton", inductor=True, group_linears=s.group_linears,
                  rotary=s.rotary) if s.device == "cuda" else \
        dict(lowering="reference", inductor=False)
    t0 = time.perf_counter()
    verifier = dspark_compile(model, page_size=s.page_size, block=s.gamma + 1, **kwargs)
    compile_s, max_c = time.perf_counter() - t0, max(s.concurrency)
    state = verifier.new_state(max_requests=max_c,
                               max_context=s.context + s.output + 2 * (s.gamma + 1))
    tiers = tier_set(max_c, s.gamma + 1)
    t0 = time.perf_counter()
    verifier.capture(state, tiers=tiers, progress=s.device == "cuda")
    capture_s, t0 = time.perf_counter() - t0, time.perf_counter()
    table = profile_sps(verifier, state, context=s.context, tiers=tiers, block=s.gamma + 1,
                        warmup=1 if s.device == "cpu" else 2, iters=s.sps_iters,
                        model=f"llama {s.model['hidden_size']}x{s.model['num_hidden_layers']} "
                              f"{s.dtype} {s.target}", progress=s.device == "cuda")
    timing = {"compile": compile_s, "capture": capture_s, "profile_sps":
              time.perf_counter() - t0, "tiers": len(tiers)}
    return model, perm, verifier, state, tiers, table, timing


@contextlib.contextmanager
def cpu_threads(s: Settings):
    """One intra-op thread for the CPU smoke run, restored after: the tiny model gains nothing
    from more, and on a loaded 2-core machine OpenMP threads waiting on each other made the
    smoke run 5x slower (78 s against 16 s)."""
    threads = torch.get_num_threads()
    if s.device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_benchmark(s: Settings, save=None) -> tuple[dict, dict]:
    """Every mode at every concurrency; (JSON data, decoded tokens per concurrency and mode).

    ``save(data)`` is called after each concurrency with the results so far."""
    with cpu_threads(s):
        return _run_benchmark(s, save)


def _run_benchmark(s: Settings, save) -> tuple[dict, dict]:
    model, perm, verifier, state, tiers, table, timing = build_verifier(s)
    print(f"compiled in {timing['compile']:.1f} s, captured {timing['tiers']} tiers in "
          f"{timing['capture']:.1f} s, SPS table in {timing['profile_sps']:.1f} s", flush=True)
    decoder = Decoder(verifier, state, s, table, tiers)
    gen = torch.Generator().manual_seed(s.seed + 2)
    data = {"environment": environment(s), "settings": asdict(s), "measured": MEASURED,
            "policies": POLICIES, "planner": {"tiers": list(decoder.planner.tiers)},
            "timing": timing, "sps_table": table.to_json(), "results": {}}
    outputs = {"perm": perm}
    for c in s.concurrency:
        prompts = torch.randint(0, s.model["vocab_size"], (c, s.context), generator=gen)
        row, outputs[c] = bench_concurrency(decoder, prompts, s)
        outputs[c]["prompts"] = prompts
        data["results"][str(c)] = {**row, "targets": targets(c, row)}
        if save is not None:
            save({**data, "partial": True})
    data["lossless"] = all(v["mismatched_tokens"] == 0 for row in data["results"].values()
                           for v in row["modes"].values())
    data["table_markdown"] = markdown_table(data["results"])
    return data, outputs


MEASURED = ("tokens/s = requests x decoded tokens / (run seconds - draft seconds); run seconds "
            "are CUDA events around the whole run (after a warm-up run of the same mode) and "
            "include planning, packing, the verify forward (tier-graph replay), the greedy "
            "accept kernel, the copy of its result to the host, commit and bookkeeping. "
            "Excluded: drafting (a synthetic table lookup; its host time is subtracted) and the "
            "prefill (shared by all modes). mean_verify_tokens_per_step: packed tokens verified "
            "per step (sum of lens); mean_tier_tokens_per_step: tokens of the tier replayed.")


POLICIES = ("width: WidthPolicy over widths 1..gamma+1 (default knobs); planner: "
            "Planner.lengths (one Planner a run: PlannerConfig.quiet_steps's state) with "
            "PlannerConfig(tiers=the captured tiers, rank_cost_s=results[c].rank_cost_ms: "
            "the planning time per step of an untimed ranked run and the ragged packing's "
            "extra time, measured per concurrency) (budget aligned up to the tier it "
            "replays). Both read the SPS table through TierRate: the rate of the tier a step "
            "of (B tokens, R requests) replays, not the table's floor to the point below B; "
            "with step_overhead, a step costs 1 / SPS + the loop's own time per step outside "
            "the replay, measured on untimed no-speculation runs of the same concurrency "
            "(results[c].step_overhead_ms).")


def environment(s: Settings) -> dict:
    return {**versions(gpu=s.device == "cuda"), "numpy": np.__version__,
            "command": " ".join(sys.argv)}


def plot(data: dict, path: str) -> None:
    """tokens/s and mean verify tokens per step against concurrency, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"]
    cs = sorted(int(c) for c in res)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, pick in (("no speculation", lambda r: "none"), ("static 8", lambda r: "static"),
                        ("best fixed width", lambda r: r["best_fixed"]),
                        ("width policy", lambda r: "width"), ("compact planner",
                                                              lambda r: "planner")):
        rows = [res[str(c)]["modes"][pick(res[str(c)])] for c in cs]
        axes[0].plot(cs, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        axes[1].plot(cs, [r["mean_verify_len_per_request"] for r in rows], marker="o",
                     label=label)
    for ax, ylabel in zip(axes, ("tokens/s", "mean verify length per request")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"end-to-end greedy speculative decoding, {data['environment']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_settings(argv=None) -> tuple[Settings, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="GPU: bs 1 and 8, 64 tokens")
    group.add_argument("--smoke", action="store_true", help="CPU: tiny random Llama, bs 1, 4")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    parser.add_argument("--target", choices=("successor", "random"), default=None)
    parser.add_argument("--mean-accepted", type=float, default=None)
    parser.add_argument("--concentration", type=float, default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help="concurrencies to run (default 1 8 64 256); the files get a suffix")
    parser.add_argument("--group-linears", choices=GROUP_LINEARS,
                        default="auto",
                        help="DSparkConfig(group_linears=...); not auto: the files get a suffix")
    parser.add_argument("--output", type=int, default=None,
                        help="tokens decoded per request (default 256; --quick 64); the files get "
                             "a suffix")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per mode, taken round the modes (default 3); the files "
                             "get a suffix")
    parser.add_argument("--replay-rates", action="store_true",
                        help="price steps for the width policy and the planner by the SPS table "
                             "of graph replays alone (no loop overhead); the files get a suffix")
    parser.add_argument("--rotary", choices=ROTARY, default="auto",
                        help="DSparkConfig(rotary=...); not auto: the files get a suffix")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else QUICK if args.quick else FULL
    changes = {k: v for k, v in (("target", args.target), ("mean_accepted", args.mean_accepted),
                                 ("concentration", args.concentration)) if v is not None}
    if args.group_linears != "auto" or args.rotary != "auto":
        suffix = variant_suffix(args.group_linears, args.rotary)
        changes.update(group_linears=args.group_linears, rotary=args.rotary,
                       name=s.name + suffix)
    if args.mean_accepted is not None:
        changes["name"] = changes.get("name", s.name) + f"_accepted{args.mean_accepted:g}"
    if args.concurrency:
        changes.update(concurrency=tuple(args.concurrency),
                       name=changes.get("name", s.name) + "_c" + "_".join(
                           str(c) for c in args.concurrency))
    for flag, value in (("output", args.output), ("repeats", args.repeats)):
        if value is not None:
            if value < 1:
                parser.error(f"--{flag}={value}: it must be at least 1")
            changes.update({flag: value, "name": changes.get("name", s.name) + f"_{flag}{value}"})
    if args.replay_rates:
        changes.update(step_overhead=False, name=changes.get("name", s.name) + "_replay_rates")
    return replace(s, **changes), args.out


def main(argv=None) -> dict:
    s, out = parse_settings(argv)
    if s.device == "cuda" and not torch.cuda.is_available():
        sys.exit("e2e.py needs a GPU for the full and --quick runs; use --smoke on the CPU")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, "e2e" if s.name == "full" else f"e2e_{s.name}")

    def save(part: dict) -> None:
        write_json(out, os.path.basename(stem) + ".json", part, allow_nan=False)

    data, _ = run_benchmark(s, save)
    try:
        plot(data, stem + ".png")
        data["png"] = stem + ".png"
    except ImportError as err:  # matplotlib is not a dependency of the package
        data["png"] = None
        print(f"no plot ({err}); the JSON has every number")
    save(data)
    print(data["table_markdown"])
    print(f"lossless (every mode decoded the reference tokens): {data['lossless']}")
    return data


if __name__ == "__main__":
    main()
