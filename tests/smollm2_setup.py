"""SmolLM2-135M-Instruct for the tests on real weights: loaded and compiled once per process.

Every test module that uses it marks itself ``xdist_group("smollm2")`` (``make test`` runs
``--dist loadgroup``), so one worker pays for the load and the compile. Without the weights
package the tests skip with one reason line (``make test`` installs it, so there they run).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

NEW_TOKENS = 16
"""Tokens decoded per prompt in the tests (few: every decode runs the 30-layer model)."""

GAMMA = 5


def skip_reason() -> str | None:
    from dspark_compile.integrations.smollm2 import unavailable_reason

    return unavailable_reason()


@functools.lru_cache(maxsize=1)
def _load():
    # Two xdist workers with torch's default of one thread per core would run 4 threads on 2
    # cores; their spin-waits cost the 30-layer model several times its time. A core each.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    from dspark_compile import dspark_compile
    from dspark_compile.demo_smollm2 import chat_prompts
    from dspark_compile.integrations.smollm2 import load_smollm2

    model, tokenizer = load_smollm2()
    return model, tokenizer, dspark_compile(model), chat_prompts(tokenizer)


def smollm2():
    """``(model, tokenizer, verifier, prompts)``, or a skip naming what is missing."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return _load()


@functools.lru_cache(maxsize=None)
def greedy(index: int, new_tokens: int = NEW_TOKENS) -> tuple[int, ...]:
    """HF's plain greedy ``generate`` of prompt ``index`` (stops at EOS)."""
    from dspark_compile.demo_smollm2 import hf_greedy

    model, _, _, prompts = smollm2()
    return tuple(hf_greedy(model, prompts[index], new_tokens))


def as_batch(prompt: torch.Tensor) -> dict:
    """``generate`` inputs of one prompt: ids and an explicit all-ones mask (SmolLM2's pad id
    is ``<|im_end|>``, which chat prompts contain)."""
    return {"input_ids": prompt[None], "attention_mask": torch.ones_like(prompt)[None]}
