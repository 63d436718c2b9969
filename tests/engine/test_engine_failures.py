"""The reference engine after a failed step, and the engine-side arguments refused by name."""

import numpy as np
import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.engine import DSparkHook, EngineConfig, ReferenceEngine, SamplingParams
from dspark_compile.engine.drafter import NoisyCopyDrafter
from dspark_compile.session.ids import TokenIdError
from helpers import full_logits, tiny_llama

VOCAB = 97


def greedy(model, prompt, n):
    seq = prompt.clone()
    for _ in range(n):
        seq = torch.cat([seq, full_logits(model, seq)[-1].argmax().view(1)])
    return seq[prompt.numel():].tolist()


@pytest.fixture(scope="module")
def setup():
    model = tiny_llama(seed=12, layers=1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (4, 6, 3)]
    return model, dspark_compile(model), prompts, [greedy(model, p, 5) for p in prompts]


class OutOfVocabOnce:
    """Drafts of ``inner``; on its ``call``-th call, request ``row``'s first draft is no token."""

    def __init__(self, inner, call: int, row: int) -> None:
        self.inner, self.call, self.row, self.calls = inner, call, row, 0

    def draft(self, sequences, gamma):
        drafts = self.inner.draft(sequences, gamma)
        self.calls += 1
        if self.calls == self.call:
            drafts.tokens[self.row, 0] = VOCAB + 7
        return drafts


@pytest.mark.parametrize("id_check", ["host", "device"])
def test_a_failed_step_fails_its_request_and_the_others_are_served(setup, id_check):
    model, verifier, prompts, want = setup
    verifier.id_check = id_check
    try:
        drafter = OutOfVocabOnce(NoisyCopyDrafter(model, noise=0.0), call=2, row=1)
        engine = ReferenceEngine(verifier, drafter, EngineConfig(mode="static", gamma=2,
                                                                 max_context=32),
                                 max_requests=2)
        ids = [engine.submit(p, 5) for p in prompts]  # three requests, two slots
        out = engine.run()
    finally:
        verifier.id_check = "host"
    failed = [r for r in ids if r in engine.failed]
    assert len(failed) == 1 and isinstance(engine.failed[failed[0]], TokenIdError)
    assert str(VOCAB + 7) in str(engine.failed[failed[0]])
    assert any(report.failed == failed for report in engine.reports)
    for rid, prompt, w in zip(ids, prompts, want):
        if rid not in failed:
            assert out[rid] == w  # the other requests, queued one included, decode exactly
    assert sorted(engine.free_slots) == [0, 1] and not engine.running
    assert engine.state.committed_lens.tolist() == [0, 0]


def test_a_fault_naming_no_request_fails_that_step_only(setup):
    model, verifier, prompts, want = setup

    class Broken:
        calls = 0

        def draft(self, sequences, gamma):
            Broken.calls += 1
            drafts = NoisyCopyDrafter(model, noise=0.0).draft(sequences, gamma)
            if Broken.calls == 1:
                return type(drafts)(drafts.tokens.float(), drafts.confidence)  # not ids
            return drafts

    engine = ReferenceEngine(verifier, Broken(), EngineConfig(mode="static", gamma=2,
                                                              max_context=32), max_requests=2)
    ids = [engine.submit(p, 5) for p in prompts]
    out = engine.run()
    assert sorted(engine.failed) == ids[:2]  # the first step's two requests
    assert out == {ids[2]: want[2]} and sorted(engine.free_slots) == [0, 1]


@pytest.mark.parametrize("prompt, new, match", [
    (torch.tensor([1, VOCAB, 2]), 3, r"prompt\[1\]=97 is outside the vocabulary 0..96"),
    (torch.tensor([1, -2]), 3, r"prompt\[1\]=-2"),
    (torch.tensor([1, 2]), 4.5, "max_new_tokens=4.5"),
    (torch.tensor([1, 2]), True, "max_new_tokens=True"),
    (torch.tensor([1, 2]), 0, "max_new_tokens=0"),
    ([1, 2], 3, "prompt has a list"),
    (torch.tensor([1.0, 2.0]), 3, "dtype torch.float32"),
    (torch.tensor([1, 2]), 40, "exceeds max_context=32"),
])
def test_submit_refuses_bad_requests_before_they_take_a_slot(setup, prompt, new, match):
    _, verifier, _, _ = setup
    engine = ReferenceEngine(verifier, None, EngineConfig(mode="none", gamma=2, max_context=32),
                             max_requests=2)
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, new)
    assert not engine.queue and engine.run() == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_context=0), "max_context=0"), (dict(max_context=True), "max_context=True"),
    (dict(gamma=True), "gamma=True"), (dict(mode="fixed", fixed_width=True), "fixed_width"),
])
def test_engine_config_refuses_coercions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=True), r"temperature\[0\]=True"),
    (dict(temperature=0.5, top_k=2.5), r"top_k\[0\]=2.5"),
    (dict(temperature=0.5, top_k=np.float32(2)), r"top_k\[0\]"),
    (dict(temperature=[0.5, False]), r"temperature\[1\]=False"),
    (dict(temperature=None), "temperature is a NoneType"),
    (dict(temperature=torch.tensor([True])), r"temperature\[0\]"),
    (dict(temperature=0.5, num_requests=True), "num_requests=True"),
])
def test_sampling_params_refuse_coercions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.build(**kwargs)


def test_sampling_params_take_numpy_scalars_and_arrays():
    p = SamplingParams.build(np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9),
                             num_requests=2)
    assert p.temperature.tolist() == [0.5, 0.5] and p.top_k.tolist() == [3, 3]
    q = SamplingParams.build(np.array([0.0, 1.0]), top_k=torch.tensor([0, 5]))
    assert q.temperature.tolist() == [0.0, 1.0] and q.top_k.tolist() == [0, 5]


def test_hook_plans_from_numpy_and_refuses_the_rest(setup):
    _, verifier, _, _ = setup
    hook = DSparkHook(verifier, max_requests=2, max_context=16, gamma=3)
    assert hook.plan(np.full((2, 3), 0.5, np.float32)).tolist() == [4, 4]
    assert hook.plan(torch.full((2, 3), 0.5)).tolist() == [4, 4]
    with pytest.raises(ValueError, match="confidence is a list"):
        hook.plan([[0.5] * 3] * 2)
    with pytest.raises(ValueError, match=r"gamma=3"):
        hook.plan(np.full((2, 4), 0.5))
    with pytest.raises(ValueError, match="gamma=True"):
        DSparkHook(verifier, max_requests=2, max_context=16, gamma=True)
    with pytest.raises(ValueError, match="slot -1"):
        hook.release([-1])
