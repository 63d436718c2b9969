"""``python -m dspark_compile demo``: compile a tiny random-weight HF Llama and verify with it.

Prints the pass report, a prefill and three verify steps with random lengths and commits, the
largest difference to HF's own forward, and the tokens run against a padded dense verify.
"""

from __future__ import annotations

import random
import time

import torch

from .layout import VerifyLayout
from .verifier import dspark_compile

__all__ = ["run_demo", "run_engine_demo"]


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def _hf_rows(model, seq: torch.Tensor, last: int) -> torch.Tensor:
    with torch.no_grad():
        return model(seq[None]).logits[0, -last:]


def run_demo(seed: int = 0, requests: int = 4, block: int = 8, steps: int = 3) -> float:
    """Run the demo; returns the largest |ragged - HF| seen."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    model = _tiny_llama(seed)
    start = time.perf_counter()
    verifier = dspark_compile(model)
    print(f"compiled in {time.perf_counter() - start:.1f} s\n{verifier.explain()}\n")
    slots = rng.sample(range(2 * requests), requests)
    state = verifier.new_state(max_requests=2 * requests, max_context=128)
    seqs = [torch.randint(0, 256, (rng.randint(5, 20),), generator=gen) for _ in slots]
    lens = [s.numel() for s in seqs]
    context, worst, run, padded = [0] * requests, 0.0, 0, 0
    for step in range(steps + 1):
        new = seqs if step == 0 else [torch.randint(0, 256, (n,), generator=gen) for n in lens]
        layout = VerifyLayout.pack(lens, context, slots)
        logits = verifier(torch.cat(new), layout, state)
        qsl = layout.query_start_loc.tolist()
        errors = []
        for i in range(requests):
            full = new[i] if step == 0 else torch.cat([seqs[i], new[i]])
            errors.append((logits[qsl[i]:qsl[i + 1]] - _hf_rows(model, full, lens[i]))
                          .abs().max().item())
        worst = max(worst, *errors)
        accept = lens if step == 0 else [rng.randint(1, n) for n in lens]
        verifier.commit(layout, accept, state)
        name = "prefill" if step == 0 else f"verify {step}"
        print(f"{name:>9}: lens {lens} accept {accept}  max |ragged - HF| = {max(errors):.2e}")
        if step:
            seqs = [torch.cat([s, t[:a]]) for s, t, a in zip(seqs, new, accept)]
            run, padded = run + sum(lens), padded + requests * block
        context = [c + a for c, a in zip(context, accept)]
        lens = [rng.randint(1, block) for _ in range(requests)]
    print(f"\nlargest difference to HF's own forward: {worst:.2e}")
    print(f"verify tokens run: {run}; a dense verify padded to the block ({block}) runs "
          f"{padded} ({padded / run:.2f}x)")
    return worst


def run_engine_demo(seed: int = 0, requests: int = 3, new_tokens: int = 12) -> bool:
    """Greedy speculative decoding through the reference engine (compact planner); prints the
    plan, acceptance and tokens of every step. Returns whether it matched plain greedy."""
    from .engine import EngineConfig, NoisyCopyDrafter, ReferenceEngine
    from .runtime import SpsEntry, SpsMetadata, SpsTable

    model = _tiny_llama(seed)
    with torch.no_grad():  # sharpen the random model so drafts carry real confidence
        model.lm_head.weight.mul_(30.0)
    # Illustrative cost curve (not a measurement): a step of B tokens costs 1 + 0.01 B ms.
    rate = SpsTable(SpsMetadata(gpu="illustrative", model="tiny"),
                    tuple(SpsEntry(b, 1000.0 / (1.0 + 0.01 * b)) for b in range(1, 129)))
    engine = ReferenceEngine(dspark_compile(model), NoisyCopyDrafter(model, noise=0.2),
                             EngineConfig(mode="planner", gamma=5, max_context=128),
                             max_requests=requests, rate=rate)
    gen = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (6, 11, 4)[:requests]]
    ids = [engine.submit(p, new_tokens) for p in prompts]
    print("\nreference engine, compact planner (gamma 5, noisy self-draft):")
    while (report := engine.step()) is not None:
        print(f"  plan {report.lens} accepted {report.accepted} -> {report.emitted} tokens")
    drafts = sum(sum(n - 1 for n in r.lens) for r in engine.reports)
    accepted = sum(sum(r.accepted) for r in engine.reports)
    steps, emitted = len(engine.reports), sum(r.emitted for r in engine.reports)
    print(f"acceptance {accepted}/{drafts} verified drafts; {emitted / steps:.2f} tokens per "
          f"step over {steps} steps")
    lossless = all(engine.finished[i] == _greedy(model, p, new_tokens)
                   for i, p in zip(ids, prompts))
    print(f"identical to plain greedy decoding of the target: {lossless}")
    return lossless


def _greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq[None]).logits[0, -1].argmax().view(1)])
    return seq[prompt.numel():].tolist()
