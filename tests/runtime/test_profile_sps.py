"""The SPS profiler: one measured point per tier, a valid table that round-trips through JSON."""

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.session.tiers import tier_set
from dspark_compile.runtime import SpsTable
from dspark_compile.runtime.profiler import profile_sps
from helpers import PlainDecoder


def test_profile_covers_every_tier_and_round_trips(tmp_path):
    verifier = dspark_compile(PlainDecoder(seed=4))
    state = verifier.new_state(max_requests=4, max_context=24)
    tiers = tier_set(4, 3)
    table = profile_sps(verifier, state, context=16, tiers=tiers, block=3, warmup=1, iters=2,
                        model="plain", progress=False)
    assert {(e.tokens, e.requests) for e in table.entries} == \
        {(t.tokens, t.request_slots) for t in tiers}
    assert all(e.steps_per_second > 0 for e in table.entries)
    assert table.metadata.tiers == tuple((t.tokens, t.request_slots) for t in tiers)
    assert state.committed_lens.tolist() == [0, 0, 0, 0]  # every slot released afterwards
    assert state.steps.has_provisional().size == 0
    path = tmp_path / "sps.json"
    table.save(path)
    assert SpsTable.load(path) == table


def test_profile_refuses_a_context_that_does_not_fit():
    verifier = dspark_compile(PlainDecoder(seed=4))
    state = verifier.new_state(max_requests=2, max_context=16)
    with pytest.raises(ValueError, match="max_context=16"):
        profile_sps(verifier, state, context=14, block=4, progress=False)


def test_profile_never_touches_a_live_slot():
    """A state with a committed request, or a verify not yet committed, is refused before any
    step runs: the profile's steps would write KV rows into the slots it times."""
    from dspark_compile import VerifyLayout

    verifier = dspark_compile(PlainDecoder(seed=4))
    state = verifier.new_state(max_requests=4, max_context=24)
    layout = VerifyLayout.pack([3], [0], [2])
    verifier(torch.arange(3), layout, state)
    before = [t.clone() for kv in state.kv_caches for t in kv]
    with pytest.raises(ValueError, match=r"slots \[2\] of the state are live"):
        profile_sps(verifier, state, context=4, block=3, progress=False)
    verifier.commit(layout, [3], state)
    with pytest.raises(ValueError, match=r"slots \[2\] of the state are live"):
        profile_sps(verifier, state, context=4, block=3, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(
        [t for kv in state.kv_caches for t in kv], before))
    assert state.committed_lens.tolist() == [0, 0, 3, 0]
