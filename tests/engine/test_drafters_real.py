"""Real drafters: prompt lookup and the early-exit self-draft.

Units on plain arrays and a tiny random Llama (lookup, outcome tracking, the shared-weight
draft model, its KV reuse), then the engine and the hook on SmolLM2-135M-Instruct: with each
drafter and the compact planner the engine decodes exactly HF's greedy ``generate``.
"""

import numpy as np
import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.engine import (EarlyExitDrafter, EngineConfig, PromptLookupDrafter,
                                   ReferenceEngine, early_exit_model)
from dspark_compile.engine.lookup import find_continuation
from dspark_compile.engine.outcomes import DraftTracker
from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable
from helpers import tiny_llama
from smollm2_setup import GAMMA, NEW_TOKENS, greedy, smollm2

pytestmark = pytest.mark.xdist_group("smollm2")

# A CPU-like step cost (measured on SmolLM2 here: ~0.25 s + ~16 ms a token).
RATE = SpsTable(SpsMetadata(gpu="cpu-like", model="smollm2"),
                tuple(SpsEntry(b, 1.0 / (0.25 + 0.016 * b)) for b in range(1, 129)))


def test_find_continuation_takes_the_longest_most_recent_ngram():
    seq = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    cont, n = find_continuation(seq, 3, max_ngram=3)
    assert n == 2 and cont.tolist() == [7, 8, 5]  # "2 3" last seen before "7 8 5"
    cont, n = find_continuation(np.array([4, 5, 6]), 3)
    assert n == 0 and cont.size == 0
    cont, n = find_continuation(np.array([1, 2, 1, 2]), 5, max_ngram=2)
    assert n == 2 and cont.tolist() == [1, 2]  # the continuation runs to the sequence's end


def test_tracker_reads_outcomes_off_the_next_sequences():
    tracker = DraftTracker()
    a, b = np.array([1, 2, 3]), np.array([7, 8])
    tracker.remember([a, b], np.array([[4, 5, 6], [9, 9, 9]]), np.array([3, 2]), ["a", "b"])
    # a: drafts 4 accepted, then the target said 7 (draft 5 wrong); b: bonus 9 equals draft 0
    # (it was not verified, but right): one right, the next unknown
    out = tracker.outcomes([np.array([7, 8, 9]), np.array([1, 2, 3, 4, 7])], 3)
    assert [(o.row, o.accepted, o.verified, o.payload) for o in out] == \
        [(0, 1, 1, "b"), (1, 1, 2, "a")]
    # a new request (no entry it extends) and a sequence that is not our drafts' prefix
    assert tracker.outcomes([np.array([5, 5, 5, 5])], 3) == []


def test_lookup_estimator_learns_from_outcomes():
    drafter = PromptLookupDrafter(refit_every=1)
    seq = torch.tensor([5, 6, 7, 8, 5, 6])  # "5 6" -> drafts "7 8 5"
    first = drafter.draft([seq], 3)
    assert first.tokens[0].tolist() == [7, 8, 5]
    for _ in range(6):  # every time the target takes all three and then says 6
        seq = torch.cat([seq, torch.tensor([7, 8, 5, 6])])
        drafts = drafter.draft([seq], 3)
    assert drafter.judged == 18 and drafter.right == 18 and drafter.acceptance() == 1.0
    assert (drafts.confidence > first.confidence).all()
    none = drafter.draft([torch.tensor([1, 2, 3])], 3)
    assert (none.confidence == 0).all()


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=5, layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model, dspark_compile(model)


def test_early_exit_model_shares_the_targets_tensors(tiny):
    model, _ = tiny
    draft = early_exit_model(model, 2)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    assert draft.model.layers[1] is model.model.layers[1] and draft.lm_head is model.lm_head
    assert draft.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="layers=3"):
        early_exit_model(model, 3)


def test_early_exit_drafter_reuses_its_cache_and_is_lossless(tiny):
    model, verifier = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 9, 4)]
    drafter = EarlyExitDrafter(model, 2, stop_below=0.0)
    engine = ReferenceEngine(verifier, drafter, EngineConfig(mode="static", gamma=3,
                                                            max_context=64), max_requests=3)
    ids = [engine.submit(p, 12) for p in prompts]
    out = engine.run()
    with torch.no_grad():
        for i, p in zip(ids, prompts):
            want = model.generate(p[None], max_new_tokens=12, do_sample=False,
                                  eos_token_id=None)[0, p.numel():]
            assert out[i] == want.tolist()
    steps = len(engine.reports)
    # with its caches kept, a step feeds each request its new tokens and gamma - 1 drafts; a
    # recompute would feed whole sequences every time
    assert drafter.forward_tokens < sum(p.numel() for p in prompts) + steps * 3 * (3 + 4)
    assert drafter.judged > 0


# ---------------------------------------------------------------------- SmolLM2


@pytest.mark.parametrize("which", ["lookup", "early_exit"])
def test_engine_with_real_drafter_decodes_hf_greedy(which):
    model, tokenizer, verifier, prompts = smollm2()
    drafter = PromptLookupDrafter() if which == "lookup" else EarlyExitDrafter(model, 12)
    engine = ReferenceEngine(verifier, drafter, EngineConfig(mode="planner", gamma=GAMMA,
                                                            max_context=128),
                             max_requests=3, rate=RATE)
    ids = [engine.submit(p, NEW_TOKENS) for p in prompts[:3]]
    out = engine.run()
    eos = tokenizer.eos_token_id
    for k, i in enumerate(ids):
        got = out[i][:out[i].index(eos) + 1] if eos in out[i] else out[i]
        assert tuple(got) == greedy(k)
    verified = sum(sum(n - 1 for n in r.lens) for r in engine.reports)
    accepted = sum(sum(r.accepted) for r in engine.reports)
    assert drafter.judged > 0 and verified > 0
    if which == "lookup":  # "repeat this sentence" drafts itself
        assert accepted >= 5
