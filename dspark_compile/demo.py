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

__all__ = ["run_demo"]


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
