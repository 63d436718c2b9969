"""Ragged verify equals the model's own forward over each request's whole sequence.

For every request i and row j < len_i, row query_start_loc[i] + j of the packed logits equals
the model's own logits (HF transformers' forward, or the plain model's) at that token, over the
request's prompt + committed + new tokens alone. Tolerance 1e-5 (float32, CPU).
"""

import random

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import PlainDecoder, Session, tiny_llama, tiny_qwen3

TOL = 1e-5
MODELS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "plain": PlainDecoder}


@pytest.fixture(scope="module", params=sorted(MODELS))
def compiled(request):
    model = MODELS[request.param]()
    return model, dspark_compile(model)


def vocab_of(model):
    return model.config.vocab_size if hasattr(model, "config") else model.head.out_features


def run_rounds(model, verifier, slots, prompt_lens, rounds, lens_fn, seed=0):
    session = Session(model, verifier, slots, seed=seed)
    session.vocab = vocab_of(model)
    session.step(prompt_lens, accept=prompt_lens)  # prefill: commit the whole prompt
    rng = random.Random(seed)
    for _ in range(rounds):
        session.step(lens_fn(rng, len(slots)))
    return session


SCENARIOS = {
    "random lengths 1..8": ([0, 1, 2, 3], [5, 9, 3, 12], lambda r, n: [r.randint(1, 8)
                                                                        for _ in range(n)]),
    "batch of one": ([0], [7], lambda r, n: [r.randint(1, 8)]),
    "all lengths equal": ([0, 1, 2], [4, 4, 4], lambda r, n: [5] * n),
    "all lengths 1": ([0, 1, 2], [6, 2, 9], lambda r, n: [1] * n),
    "N not a multiple of bs": ([0, 1, 2], [3, 5, 8], lambda r, n: [2, 3, 2]),
    "slots in any order": ([5, 2, 7, 0], [4, 6, 2, 3], lambda r, n: [r.randint(1, 8)
                                                                      for _ in range(n)]),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_ragged_equals_own_forward(compiled, scenario):
    model, verifier = compiled
    slots, prompts, lens_fn = SCENARIOS[scenario]
    session = run_rounds(model, verifier, slots, prompts, rounds=3, lens_fn=lens_fn)
    assert session.max_err < TOL, f"{scenario}: max |ragged - own forward| = {session.max_err}"


def test_commit_drops_rejected_tokens(compiled):
    """A request that rejects everything continues from its old length: rejected KV is dead."""
    model, verifier = compiled
    session = Session(model, verifier, [1, 0])
    session.vocab = vocab_of(model)
    session.step([4, 6], accept=[4, 6])
    session.step([8, 8], accept=[1, 1])
    session.step([8, 3], accept=[8, 2])
    session.step([2, 5])
    assert session.max_err < TOL
    assert [s.numel() for s in session.seqs][:2] == [
        int(session.state.committed_lens[1]), int(session.state.committed_lens[0])]


def test_input_checks_before_any_launch(compiled):
    model, verifier = compiled
    from dspark_compile import VerifyLayout

    state = verifier.new_state(max_requests=2, max_context=16)
    layout = VerifyLayout.pack([2], [0], [0])
    pools = [k.clone() for k, _ in state.kv_caches]
    with pytest.raises(ValueError, match="int64"):
        verifier(torch.zeros(2, dtype=torch.int32), layout, state)
    with pytest.raises(ValueError, match="input_ids has 3 rows"):
        verifier(torch.zeros(3, dtype=torch.int64), layout, state)
    with pytest.raises(ValueError, match="VerifyLayout"):
        verifier(torch.zeros(2, dtype=torch.int64), [2], state)
    assert all(torch.equal(a, k) for a, (k, _) in zip(pools, state.kv_caches))
