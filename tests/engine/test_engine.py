"""The reference engine: greedy speculative decoding emits exactly plain greedy decoding."""

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.engine.drafter import NoisyCopyDrafter
from dspark_compile.engine.loop import MODES, EngineConfig, ReferenceEngine
from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable
from helpers import full_logits, tiny_llama

RATE = SpsTable(SpsMetadata(gpu="synthetic", model="tiny"),
                tuple(SpsEntry(b, 1000.0 / (1.0 + 0.02 * b)) for b in range(1, 65)))


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    seq = prompt.clone()
    for _ in range(n):
        seq = torch.cat([seq, full_logits(model, seq)[-1].argmax().view(1)])
    return seq[prompt.numel():].tolist()


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=11)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (5, 9, 3, 7, 4)]
    want = [greedy(model, p, 10) for p in prompts]
    return model, dspark_compile(model), prompts, want


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_is_lossless_under_greedy(setup, mode):
    model, verifier, prompts, want = setup
    config = EngineConfig(mode=mode, gamma=3, fixed_width=2 if mode == "fixed" else None,
                          max_context=64)
    engine = ReferenceEngine(verifier, NoisyCopyDrafter(model, noise=0.5, seed=1), config,
                             max_requests=3, rate=RATE)
    ids = [engine.submit(p, 10) for p in prompts]  # 5 requests, 3 slots: arrivals and reuse
    out = engine.run()
    assert [out[i] for i in ids] == want
    if mode == "none":
        assert all(r.lens == [1] * r.requests for r in engine.reports)
    if mode == "static":
        assert all(r.lens == [4] * r.requests for r in engine.reports)


def test_exact_drafter_accepts_every_draft(setup):
    model, verifier, prompts, want = setup
    engine = ReferenceEngine(verifier, NoisyCopyDrafter(model, noise=0.0),
                             EngineConfig(mode="static", gamma=3, max_context=64),
                             max_requests=5)
    ids = [engine.submit(p, 10) for p in prompts]
    out = engine.run()
    assert [out[i] for i in ids] == want
    first = engine.reports[0]
    assert first.accepted == [3] * first.requests and first.emitted == 4 * first.requests


def test_bad_requests_and_configs_are_refused(setup):
    model, verifier, _, _ = setup
    with pytest.raises(ValueError, match="fixed_width"):
        EngineConfig(mode="fixed", gamma=3)
    with pytest.raises(ValueError, match="mode="):
        EngineConfig(mode="eager")
    with pytest.raises(ValueError, match="rate model"):
        ReferenceEngine(verifier, NoisyCopyDrafter(model, 0.1), EngineConfig(mode="width"), 2)
    engine = ReferenceEngine(verifier, NoisyCopyDrafter(model, 0.1),
                             EngineConfig(mode="static", gamma=3, max_context=32), 2)
    with pytest.raises(ValueError, match="exceeds max_context"):
        engine.submit(torch.zeros(20, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="int64"):
        engine.submit(torch.zeros(3, dtype=torch.int32), 2)
