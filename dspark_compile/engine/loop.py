"""Reference speculative-decoding engine: draft -> plan -> verify -> accept -> commit.

A batch of requests with arrivals and completions over one :class:`Verifier` and its state.
Each step, every running request has an *anchor* (its last emitted token, not yet in the
cache); the drafter proposes ``gamma`` tokens after it; the mode decides how many of them each
request verifies (``len = 1 + drafts``); one packed forward verifies all requests; the accept
step keeps a prefix and emits one more token; ``commit`` keeps the anchor and the accepted
drafts in the cache. Modes:

``none``     no speculation: every request verifies only its anchor (plain decoding)
``static``   every request verifies the whole block (``gamma + 1``)
``fixed``    every request verifies ``fixed_width``
``width``    one uniform width per step from :class:`WidthPolicy` (measured hazards, SPS)
``planner``  ragged lengths from a :class:`Planner` (draft confidence, SPS)

With greedy acceptance the emitted tokens are exactly plain greedy decoding of the target, in
every mode (the tests hold it to that). New requests are prefilled in packed forwards of their
own when a slot frees, in chunks of at most the state's ``max_step_tokens`` rows.

A step that fails does not stop the engine. The verifier refuses a bad call before it changes
anything, naming the request at fault (``TokenIdError.request``: a token id outside the
vocabulary, from a drafter of another vocabulary, say): that request is failed, its slot given
back, and the others go on. A fault that names no request fails every request of that step
(their slots are given back too); queued requests still run. Failed requests are in ``failed``
(id -> the error), and in the step's report.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from ..layout import VerifyLayout
from ..runtime import Planner, PlannerConfig, StepRateModel, WidthPolicy, WidthPolicyConfig
from .accept import PreDrawnNoise, SamplingParams, accept, accept_reference
from .drafter import Drafter

__all__ = ["EngineConfig", "ReferenceEngine", "StepReport", "MODES"]

MODES = ("none", "static", "fixed", "width", "planner")
log = logging.getLogger("dspark_compile")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class EngineConfig:
    """How the reference engine schedules verification."""

    mode: str = "planner"
    """One of ``MODES`` (see the module docstring)."""
    gamma: int = 7
    """Draft tokens proposed per request per step (the block is ``gamma + 1``)."""
    fixed_width: int | None = None
    """Verify length of every request in mode ``fixed``, in ``1..gamma + 1``."""
    max_context: int = 512
    """Tokens a request may hold (prompt + output + one block)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """Options of the compact planner (mode ``planner``)."""
    window_rings: bool = False
    """``new_state(window_rings=...)``: sliding-window KV and compressor rows in rings (prompts
    are prefilled in chunks of at most the state's ``max_step_tokens`` either way)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"EngineConfig.mode={self.mode!r}; it must be one of {MODES}")
        if not _is_int(self.gamma) or self.gamma < 1:
            raise ValueError(f"EngineConfig.gamma={self.gamma!r}; it must be an int >= 1")
        if self.mode == "fixed" and not (_is_int(self.fixed_width)
                                         and 1 <= self.fixed_width <= self.gamma + 1):
            raise ValueError(f"EngineConfig.fixed_width={self.fixed_width!r}; mode 'fixed' "
                             f"needs an int in 1..gamma+1 = 1..{self.gamma + 1}")
        if not isinstance(self.window_rings, bool):
            raise ValueError(f"EngineConfig.window_rings={self.window_rings!r}; it must be a "
                             "bool")
        if not _is_int(self.max_context) or self.max_context < self.gamma + 2:
            raise ValueError(f"EngineConfig.max_context={self.max_context!r}; it must be an int "
                             f">= gamma + 2 = {self.gamma + 2} (a one-token prompt, its first "
                             "token and one block)")


@dataclass
class _Request:
    rid: int
    prompt: torch.Tensor
    max_new_tokens: int
    slot: int = -1
    emitted: list[int] = field(default_factory=list)

    def sequence(self) -> torch.Tensor:
        """Prompt + emitted tokens (the anchor is the last one)."""
        return torch.cat([self.prompt, torch.tensor(self.emitted, dtype=torch.int64)])


@dataclass(frozen=True)
class StepReport:
    """What one verify step did."""

    requests: int
    lens: list[int]
    """Verify length per running request."""
    accepted: list[int]
    """Drafts accepted per running request."""
    emitted: int
    """Tokens emitted by the step (accepted drafts + one per request)."""
    failed: list[int] = field(default_factory=list)
    """Ids of the requests this step failed (see the module docstring)."""


class ReferenceEngine:
    """Runs requests to completion over ``verifier`` (see the module docstring)."""

    def __init__(self, verifier, drafter: Drafter, config: EngineConfig, max_requests: int,
                 rate: StepRateModel | None = None) -> None:
        if config.mode == "width" and rate is None:
            raise ValueError("ReferenceEngine: mode 'width' needs an SPS rate model (rate=...)")
        self.verifier, self.drafter, self.config = verifier, drafter, config
        self.state = verifier.new_state(max_requests=max_requests, max_context=config.max_context,
                                        window_rings=config.window_rings)
        self.rate = rate
        self.width_policy = WidthPolicy(WidthPolicyConfig(
            gamma=config.gamma, widths=tuple(range(1, config.gamma + 2))), rate) \
            if config.mode == "width" else None
        self.planner = Planner(rate, config.planner)  # PlannerConfig.quiet_steps's state
        self.free_slots = deque(range(max_requests))
        self.queue: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.finished: dict[int, list[int]] = {}
        self.failed: dict[int, Exception] = {}
        """Requests a step failed: id -> the error (naming the request)."""
        self.reports: list[StepReport] = []
        self._next_id = 0

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: torch.Tensor, max_new_tokens: int) -> int:
        """Queue a request; returns its id (its output is ``finished[id]`` when done).

        ``prompt``: a non-empty int64 tensor ``[L]`` of ids in the verifier's vocabulary;
        ``max_new_tokens``: an int >= 1 that fits ``max_context`` with the prompt and a block.
        Anything else is refused here, before the request takes a slot."""
        if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1 or prompt.numel() < 1 \
                or prompt.dtype != torch.int64:
            what = f"shape {tuple(prompt.shape)} and dtype {prompt.dtype}" if isinstance(
                prompt, torch.Tensor) else f"a {type(prompt).__name__}"
            raise ValueError(f"submit: prompt has {what}; it must be a non-empty int64 tensor "
                             "[L]")
        vocab = getattr(self.verifier, "vocab_size", None)
        if vocab is not None:
            bad = (prompt < 0) | (prompt >= vocab)
            if bad.any():
                j = int(bad.nonzero()[0])
                raise ValueError(f"submit: prompt[{j}]={int(prompt[j])} is outside the "
                                 f"vocabulary 0..{vocab - 1} (vocab_size={vocab})")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"submit: max_new_tokens={max_new_tokens!r}; it must be an int >= 1")
        need = prompt.numel() + max_new_tokens + self.config.gamma + 1
        if need > self.config.max_context:
            raise ValueError(f"submit: prompt {prompt.numel()} + max_new_tokens {max_new_tokens}"
                             f" + block {self.config.gamma + 1} = {need} exceeds max_context="
                             f"{self.config.max_context}")
        rid, self._next_id = self._next_id, self._next_id + 1
        self.queue.append(_Request(rid, prompt.cpu(), max_new_tokens))
        return rid

    def _admit(self) -> None:
        """Prefill queued requests into free slots and emit their first token: packed forwards
        of at most the state's ``max_step_tokens`` rows, each request's prompt in order (one
        forward when it fits)."""
        new = []
        while self.queue and self.free_slots:
            req = self.queue.popleft()
            req.slot = self.free_slots.popleft()
            new.append(req)
        if not new:
            return
        lens = [r.prompt.numel() for r in new]
        bound = self.state.max_step_tokens or sum(lens)
        done, first = [0] * len(new), [0] * len(new)
        while True:
            active = [i for i in range(len(new)) if done[i] < lens[i]][:bound]
            if not active:
                break
            share = bound // len(active)
            take = [min(lens[i] - done[i], share) for i in active]
            chunk = [new[i] for i in active]
            layout = VerifyLayout.pack(take, [done[i] for i in active], [r.slot for r in chunk])
            ids = torch.cat([r.prompt[done[i]:done[i] + t]
                             for r, i, t in zip(chunk, active, take)]).to(self.verifier.device)
            try:
                logits = self.verifier(ids, layout, self.state)
                last = layout.query_start_loc[1:].long() - 1
                tops = logits[last.to(logits.device)].float().argmax(dim=-1).tolist()
                self.verifier.commit(layout, take, self.state)
            except Exception as err:  # noqa: BLE001 - a failed step fails requests, not the engine
                failed = self._fail(chunk, err)
                for req in reversed([r for r in new if r.rid not in failed]):
                    self.state.release([req.slot])  # its prefill so far is dropped
                    self.free_slots.appendleft(req.slot)
                    req.slot = -1
                    self.queue.appendleft(req)
                self.reports.append(StepReport(0, [], [], 0, failed))
                return
            for i, t, tok in zip(active, take, tops):
                done[i] += t
                first[i] = tok
        for req, tok in zip(new, first):
            req.emitted.append(tok)
        self.running.extend(new)
        self._retire()

    def _retire(self) -> None:
        for req in [r for r in self.running if len(r.emitted) >= r.max_new_tokens]:
            self.finished[req.rid] = req.emitted[:req.max_new_tokens]
            self.running.remove(req)
            self.state.release([req.slot])
            self.free_slots.append(req.slot)

    # ------------------------------------------------------------------ one step
    def _lens(self, confidence: torch.Tensor) -> list[int]:
        cfg, r = self.config, len(self.running)
        if cfg.mode == "none":
            return [1] * r
        if cfg.mode == "static":
            return [cfg.gamma + 1] * r
        if cfg.mode == "fixed":
            return [cfg.fixed_width] * r
        if cfg.mode == "width":
            return [self.width_policy.choose(r)] * r
        self.planner = self.planner.follow(self.rate, cfg.planner)  # a swap: a fresh one
        return self.planner(confidence).lens.tolist()

    def step(self) -> StepReport | None:
        """Admit, draft, plan, verify, accept, commit; None when nothing is left to run."""
        self._admit()
        if not self.running:
            return None
        cfg, reqs = self.config, self.running
        drafts = self.drafter.draft([r.sequence() for r in reqs], cfg.gamma) \
            if cfg.mode != "none" else None
        confidence = drafts.confidence if drafts is not None else None
        lens = self._lens(confidence)
        rows = [torch.cat([torch.tensor([r.emitted[-1]]), drafts.tokens[i, :n - 1]])
                if n > 1 else torch.tensor([r.emitted[-1]]) for i, (r, n) in
                enumerate(zip(reqs, lens))]
        context = [r.prompt.numel() + len(r.emitted) - 1 for r in reqs]
        layout = VerifyLayout.pack(lens, context, [r.slot for r in reqs])
        ids = torch.cat(rows).to(self.verifier.device)
        try:
            logits = self.verifier(ids, layout, self.state)
            result = self._accept(logits, ids, layout)
            self.verifier.commit(layout, result.accept_lens.cpu(), self.state)
        except Exception as err:  # noqa: BLE001 - a failed step fails requests, not the engine
            report = StepReport(len(reqs), lens, [0] * len(reqs), 0, self._fail(reqs, err))
            self.reports.append(report)
            return report
        accepted = result.num_accepted_drafts.tolist()
        for req, row, a, tok in zip(reqs, rows, accepted, result.next_tokens.tolist()):
            req.emitted.extend(row[1:1 + a].tolist() + [tok])
        if self.width_policy is not None:
            hist = torch.bincount(torch.tensor(accepted), minlength=cfg.gamma + 1)
            self.width_policy.observe(lens[0], hist)
        report = StepReport(len(reqs), lens, accepted, sum(accepted) + len(reqs))
        self.reports.append(report)
        self._retire()
        return report

    def _fail(self, reqs: list[_Request], err: Exception) -> list[int]:
        """Fail the request of ``reqs`` that ``err`` names (``err.request``, its index), or all
        of them when it names none; give back their slots. Returns the failed ids."""
        i = getattr(err, "request", None)
        culprits = [reqs[i]] if isinstance(i, int) and 0 <= i < len(reqs) else list(reqs)
        for req in culprits:
            self.failed[req.rid] = err
            log.warning("dspark_compile: ReferenceEngine failed request %d: %s", req.rid, err)
            if req in self.running:
                self.running.remove(req)
            if req.slot >= 0:
                self.state.release([req.slot])
                self.free_slots.append(req.slot)
                req.slot = -1
        return [r.rid for r in culprits]

    def _accept(self, logits: torch.Tensor, ids: torch.Tensor, layout: VerifyLayout):
        """Greedy acceptance (temperature 0): noise is unused, zeros keep the shapes right."""
        n, v = logits.shape
        r, dev = layout.num_requests, logits.device
        sampling = SamplingParams.build(0.0, num_requests=r, device=dev)
        noise = PreDrawnNoise(torch.zeros(n, device=dev), torch.zeros(r, v, device=dev))
        qsl = layout.query_start_loc.to(dev)
        fn = accept if dev.type == "cuda" else accept_reference
        return fn(logits, ids, qsl, sampling, noise)

    def run(self) -> dict[int, list[int]]:
        """Step until every submitted request has finished; returns ``{id: emitted tokens}``."""
        while self.step() is not None:
            pass
        return self.finished
