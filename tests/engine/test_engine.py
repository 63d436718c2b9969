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


@pytest.mark.parametrize("family", ["llama", "mistral_rings"])
def test_long_prompts_prefill_in_chunks_losslessly(family):
    """Prompts longer than ``max_step_tokens`` (8) are prefilled in chunks: a Llama, and a
    sliding-window model whose KV lives in rings (``window_rings``), decode exactly greedy."""
    import transformers as T

    if family == "llama":
        model = tiny_llama(seed=3)
        vocab = 97
    else:
        torch.manual_seed(0)
        model = T.MistralForCausalLM(T.MistralConfig(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
        vocab = 96
    verifier = dspark_compile(model, max_step_tokens=8, page_size=4)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (13, 20, 6, 9)]
    want = [greedy(model, p, 8) for p in prompts]
    config = EngineConfig(mode="static", gamma=3, max_context=64,
                          window_rings=family == "mistral_rings")
    engine = ReferenceEngine(verifier, NoisyCopyDrafter(model, noise=0.3, seed=2), config,
                             max_requests=2)
    assert engine.state.max_step_tokens == 8
    assert bool(engine.state.window_step_tokens) == (family == "mistral_rings")
    ids = [engine.submit(p, 8) for p in prompts]
    out = engine.run()
    assert [out[i] for i in ids] == want and not engine.failed
