"""Hybrid models (Gated DeltaNet + full attention) against HF transformers' own forward.

Every ragged logit row equals HF's forward over that request's prompt + committed + new tokens
alone, over a prefill and verify/commit rounds with random lengths and accepted prefixes
(float32, CPU, reference ops). Containment: a NaN token at rejected draft positions leaves the
accepted outputs and the committed conv and recurrent state bit-identical to a clean run.
"""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from helpers import Session, full_logits, tiny_qwen35

TOL = 1e-4
VOCAB = 101
POISON = VOCAB - 1  # a token id whose embedding row is NaN in the containment test


@pytest.fixture(scope="module")
def compiled():
    model = tiny_qwen35(vocab=VOCAB)
    return model, dspark_compile(model)


def run_rounds(model, verifier, slots, prompts, rounds, lens_fn, seed=0):
    session = Session(model, verifier, slots, seed=seed)
    session.vocab = VOCAB - 1  # never draw the poison id
    session.step(prompts, accept=prompts)
    rng = random.Random(seed)
    for _ in range(rounds):
        session.step(lens_fn(rng, len(slots)))
    return session


@pytest.mark.parametrize("slots,prompts,lens_fn", [
    ([5, 2, 7, 0], [4, 9, 3, 12], lambda r, n: [r.randint(1, 8) for _ in range(n)]),
    ([0, 1, 2], [3, 5, 8], lambda r, n: [2, 3, 2]),          # N not a multiple of bs
    ([3], [6], lambda r, n: [r.randint(1, 8)]),
], ids=["random lengths, slots in any order", "N not a multiple of bs", "batch of one"])
def test_ragged_equals_hf_forward(compiled, slots, prompts, lens_fn):
    model, verifier = compiled
    session = run_rounds(model, verifier, slots, prompts, rounds=4, lens_fn=lens_fn)
    assert session.max_err < TOL, f"max |ragged - HF| = {session.max_err}"


def test_passes_rewrote_every_linear_layer(compiled):
    _, verifier = compiled
    done = {r.name: r.changed for r in verifier.results}
    assert done["ragged_conv"] == 2 and done["ragged_linear_attention"] == 2
    ops = {str(n.target) for n in verifier.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("dense_" in op for op in ops), ops


def _step(verifier, state, tokens, context, slots):
    layout = VerifyLayout.pack([t.numel() for t in tokens], context, slots)
    return verifier(torch.cat(tokens), layout, state), layout


def _linear_state(state):
    return [t.clone() for t in (*state.linear.conv_states, *state.linear.recurrent_states)]


def test_nan_draft_cannot_reach_accepted_rows_or_state(compiled):
    """Rejected drafts hold a token with a NaN embedding: nothing accepted changes, bitwise."""
    model, verifier = compiled
    gen = torch.Generator().manual_seed(1)
    slots, prompts = [4, 1, 6], [5, 3, 7]
    states = [verifier.new_state(max_requests=8, max_context=96) for _ in range(2)]
    with torch.no_grad():
        saved = model.model.embed_tokens.weight[POISON].clone()
        model.model.embed_tokens.weight[POISON] = float("nan")
    try:
        ctx = [0] * len(slots)
        prompt = [torch.randint(0, POISON, (n,), generator=gen) for n in prompts]
        for state in states:
            _, layout = _step(verifier, state, prompt, ctx, slots)
            verifier.commit(layout, prompts, state)
        ctx = list(prompts)
        rng = random.Random(1)
        for _ in range(4):
            lens = [rng.randint(2, 8) for _ in slots]
            accept = [rng.randint(1, n - 1) for n in lens]  # always something rejected
            clean = [torch.randint(0, POISON, (n,), generator=gen) for n in lens]
            poisoned = [torch.cat([c[:a], torch.full((n - a,), POISON)])
                        for c, a, n in zip(clean, accept, lens)]
            outs = []
            for state, tokens in zip(states, (clean, poisoned)):
                logits, layout = _step(verifier, state, tokens, ctx, slots)
                verifier.commit(layout, accept, state)
                outs.append(logits)
            qsl = layout.query_start_loc.tolist()
            for i, a in enumerate(accept):
                rows = slice(qsl[i], qsl[i] + a)
                assert torch.isfinite(outs[0][rows]).all()
                assert torch.equal(outs[0][rows], outs[1][rows]), f"request {i}"
            assert not torch.isfinite(outs[1]).all(), "the poison token must produce NaN"
            for a, b in zip(_linear_state(states[0]), _linear_state(states[1])):
                assert torch.equal(a, b)
            ctx = [c + a for c, a in zip(ctx, accept)]
    finally:
        with torch.no_grad():
            model.model.embed_tokens.weight[POISON] = saved


def test_release_zeroes_linear_state_for_a_new_request(compiled):
    model, verifier = compiled
    session = Session(model, verifier, [2, 0], seed=3)
    session.vocab = VOCAB - 1
    session.step([6, 4], accept=[6, 4])
    session.step([3, 5])
    assert any(p[2].abs().sum() > 0 for p in _linear_state(session.state))
    session.state.release([2])
    assert all(p[2].abs().sum() == 0 for p in _linear_state(session.state))
    # a new request in slot 2 matches HF's forward over its own tokens from scratch
    fresh = torch.randint(0, POISON, (5,), generator=torch.Generator().manual_seed(4))
    layout = VerifyLayout.pack([5], [0], [2])
    logits = verifier(fresh, layout, session.state)
    assert (logits - full_logits(model, fresh)).abs().max() < TOL


def test_forward_longer_than_the_rings_is_refused(compiled):
    _, verifier = compiled
    state = verifier.new_state(max_requests=2, max_context=64, max_step_tokens=8)
    layout = VerifyLayout.pack([5, 4], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="max_step_tokens=8"):
        verifier(torch.zeros(9, dtype=torch.int64), layout, state)
    assert all(p.abs().sum() == 0 for p in _linear_state(state))


def test_tier_buffers_commit_like_the_plain_path(compiled, monkeypatch):
    """After ``capture`` the commit goes through the static, padded buffers (one graph per
    request-slot count on a GPU): padded requests sit in slot 0 and accept nothing, and slot 0
    also holds a real request here. Logits and every conv and recurrent state match the plain
    path, and the static commit is the one that ran."""
    _, verifier = compiled
    from dspark_compile.session.graphs import TierGraphs

    used = []
    original = TierGraphs.replay_commit
    monkeypatch.setattr(TierGraphs, "replay_commit",
                        lambda self, *a: used.append(original(self, *a)) or used[-1])
    gen = torch.Generator().manual_seed(5)
    slots, prompts = [0, 3, 5], [6, 2, 9]
    states = [verifier.new_state(max_requests=8, max_context=96) for _ in range(2)]
    verifier.capture(states[1], block=8, use_graphs=False)
    ctx = [0] * len(slots)
    prompt = [torch.randint(0, POISON, (n,), generator=gen) for n in prompts]
    for state in states:
        _, layout = _step(verifier, state, prompt, ctx, slots)
        verifier.commit(layout, prompts, state)
    ctx, rng = list(prompts), random.Random(5)
    for _ in range(4):
        lens = [rng.randint(1, 8) for _ in slots]
        accept = [rng.randint(1, n) for n in lens]
        tokens = [torch.randint(0, POISON, (n,), generator=gen) for n in lens]
        outs = []
        for state in states:
            logits, layout = _step(verifier, state, tokens, ctx, slots)
            verifier.commit(layout, accept, state)
            outs.append(logits.clone())
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(_linear_state(states[0]), _linear_state(states[1])):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
        ctx = [c + a for c, a in zip(ctx, accept)]
    assert used and all(used), "the static-buffer commit must have run"
