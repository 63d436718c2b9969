"""The verify/commit protocol, one misuse class at a time (issue 23): each is refused with a
``ValueError`` naming the argument or the cause, and leaves the state as it was.

The same classes run end to end in ``benchmarks/protocol_audit.py``; the random mix of them is
``tests/session/test_protocol_machine.py``.
"""

import numpy as np
import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.state import ProtocolError
from helpers import PlainDecoder, full_logits

VOCAB = 61


@pytest.fixture(scope="module")
def plain():
    model = PlainDecoder(vocab=VOCAB, seed=6)
    return model, dspark_compile(model)


def tokens(n, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def snapshot(state):
    return [t.clone() for kv in state.kv_caches for t in kv] + [
        state.committed_lens.clone(), state.steps.snapshot()]


def assert_unchanged(state, before):
    after = snapshot(state)
    assert all(torch.equal(a, b) for a, b in zip(after[:-1], before[:-1]))
    assert after[-1] == before[-1]


def prefill(verifier, state, seqs):
    slots = sorted(seqs)
    layout = VerifyLayout.pack([seqs[s].numel() for s in slots], [0] * len(slots), slots)
    verifier(torch.cat([seqs[s] for s in slots]), layout, state)
    verifier.commit(layout, [seqs[s].numel() for s in slots], state)


# ----------------------------------------------------------------------------------- rewind
def test_rewind_is_refused_and_names_the_committed_length(plain):
    model, verifier = plain
    state = verifier.new_state(max_requests=2, max_context=32)
    seq = tokens(8)
    prefill(verifier, state, {0: seq})
    before = snapshot(state)
    with pytest.raises(ValueError, match=r"context_lens=4 but slot 0 has 8 committed tokens.*"
                                         r"rewind"):
        verifier(tokens(3, 1), VerifyLayout.pack([3], [4], [0]), state)
    assert_unchanged(state, before)
    new = tokens(2, 2)  # the request goes on from its committed tokens, untouched
    got = verifier(new, VerifyLayout.pack([2], [8], [0]), state)
    torch.testing.assert_close(got, full_logits(model, torch.cat([seq, new]))[8:],
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ commit tied to its verify
def test_commit_without_a_verify_is_refused(plain):
    _, verifier = plain
    state = verifier.new_state(max_requests=2, max_context=16)
    before = snapshot(state)
    with pytest.raises(ProtocolError, match=r"request 0 \(slot 0\) holds no provisional rows"):
        verifier.commit(VerifyLayout.pack([4], [0], [0]), [4], state)
    with pytest.raises(ProtocolError, match="no provisional rows"):  # would pass max_context
        verifier.commit(VerifyLayout.pack([20], [0], [0]), [20], state)
    assert_unchanged(state, before)


def test_commit_of_a_layout_overwritten_by_a_later_verify_is_refused(plain):
    _, verifier = plain
    state = verifier.new_state(max_requests=3, max_context=16)
    one = VerifyLayout.pack([4, 2], [0, 0], [0, 2])
    two = VerifyLayout.pack([2], [0], [2])
    verifier(tokens(6), one, state)
    verifier(tokens(2, 1), two, state)
    before = snapshot(state)
    with pytest.raises(ProtocolError, match=r"request 1 \(slot 2\).*later forward of another "
                                            r"layout \(slots \[2\]"):
        verifier.commit(one, [4, 2], state)
    assert_unchanged(state, before)
    verifier.commit(two, [1], state)  # the last verify over slot 2 is committable
    assert state.committed_lens.tolist() == [0, 0, 1]


def test_commit_on_another_state_and_twice_are_refused(plain):
    _, verifier = plain
    a = verifier.new_state(max_requests=2, max_context=16)
    b = verifier.new_state(max_requests=2, max_context=16)
    layout = VerifyLayout.pack([3], [0], [1])
    verifier(tokens(3), layout, a)
    before = snapshot(b)
    with pytest.raises(ProtocolError, match="no forward of this layout ran on this state"):
        verifier.commit(layout, [3], b)
    assert_unchanged(b, before)
    verifier.commit(layout, [2], a)
    before = snapshot(a)
    with pytest.raises(ValueError, match="already committed; commit each step once"):
        verifier.commit(layout, [2], a)
    assert_unchanged(a, before)


def test_an_equal_layout_commits_and_a_release_forgets_the_rows(plain):
    """A layout packed again with the same values is the same step; a released slot holds no
    provisional rows."""
    _, verifier = plain
    state = verifier.new_state(max_requests=2, max_context=16)
    verifier(tokens(3), VerifyLayout.pack([3], [0], [1]), state)
    verifier.commit(VerifyLayout.pack([3], [0], [1]), [3], state)
    layout = VerifyLayout.pack([2], [3], [1])
    verifier(tokens(2), layout, state)
    state.release([1])
    state.committed_lens[1] = 3  # even with the length put back by hand
    with pytest.raises(ProtocolError, match="since the slot was last released"):
        verifier.commit(layout, [1], state)


def test_a_failed_forward_leaves_nothing_to_commit(plain):
    _, verifier = plain
    state = verifier.new_state(max_requests=2, max_context=16)
    layout = VerifyLayout.pack([3], [0], [0])
    verifier(tokens(3), layout, state)
    weights = verifier._weights
    verifier._weights = {}  # the forward raises midway (a KeyError binding its weights)
    try:
        with pytest.raises(KeyError):
            verifier(tokens(3), layout, state)
    finally:
        verifier._weights = weights
    with pytest.raises(ProtocolError, match="the last forward over this slot raised"):
        verifier.commit(layout, [3], state)


# --------------------------------------------------------------------------- aliased buffers
@pytest.mark.parametrize("kind", ["numpy", "tensor"])
@pytest.mark.parametrize("reused", [0, -1])
def test_a_layout_owns_its_arrays(plain, kind, reused):
    """The engine's buffers may change right after ``pack``: the layout keeps what it was
    built from (a duplicate or a negative slot never reaches the pools)."""
    model, verifier = plain
    state = verifier.new_state(max_requests=3, max_context=32)
    seqs = {s: tokens(5, s) for s in range(3)}
    prefill(verifier, state, seqs)
    make = (lambda v: np.array(v, np.int32)) if kind == "numpy" else \
        (lambda v: torch.tensor(v, dtype=torch.int32))
    slots, ctx = make([0, 1]), make([5, 5])
    layout = VerifyLayout.pack(make([2, 2]), ctx, slots)
    slots[1], ctx[0] = reused, 0
    assert layout.slots.tolist() == [0, 1] and layout.context_lens.tolist() == [5, 5]
    new = tokens(4, 9)
    got = verifier(new, layout, state).clone()
    verifier.commit(layout, [2, 2], state)
    assert state.committed_lens.tolist() == [7, 7, 5]
    for i in range(2):
        want = full_logits(model, torch.cat([seqs[i], new[2 * i:2 * i + 2]]))[5:]
        torch.testing.assert_close(got[2 * i:2 * i + 2], want, rtol=1e-4, atol=1e-4)


def test_a_layout_written_in_place_is_refused(plain):
    _, verifier = plain
    state = verifier.new_state(max_requests=3, max_context=16)
    layout = VerifyLayout.pack([2], [0], [0])
    assert not layout.host[2].flags.writeable
    layout.slots[0] = 2  # through the tensor: its version moves
    with pytest.raises(ValueError, match="written in place after the layout was built"):
        verifier(tokens(2), layout, state)


# ------------------------------------------------------------------------- out-of-vocab ids
@pytest.mark.parametrize("bad, row", [(VOCAB, 2), (-1, 0), (2 ** 40, 1)])
def test_out_of_vocabulary_ids_are_refused_before_the_forward(plain, bad, row):
    from dspark_compile.session.ids import TokenIdError

    _, verifier = plain
    state = verifier.new_state(max_requests=3, max_context=16)
    ids = tokens(5)
    ids[2 + row] = bad  # request 1 (slot 0) owns rows 2..4
    before = snapshot(state)
    with pytest.raises(TokenIdError, match=rf"request 1 \(slot 0\) has token id {bad} at its "
                                           rf"row {row}, outside the vocabulary 0..60") as err:
        verifier(ids, VerifyLayout.pack([2, 3], [0, 0], [2, 0]), state)
    assert err.value.request == 1
    assert_unchanged(state, before)


# ------------------------------------------------------------------------- release coercions
@pytest.mark.parametrize("slots, match", [
    (torch.tensor([True, False, False]), "dtype torch.bool"),
    (np.array([True, False]), "dtype bool"),
    ([True], "holds a bool"),
    ([-1], "slot -1; slots must be in 0..max_requests-1 = 0..2"),
    ([1.7], "non-integer"),
    (torch.tensor([1.0]), "dtype torch.float32"),
    ([3], "slot 3"),
    ("0", "str"),
])
def test_release_refuses_what_is_not_a_slot_id(plain, slots, match):
    _, verifier = plain
    state = verifier.new_state(max_requests=3, max_context=16)
    prefill(verifier, state, {s: tokens(3, s) for s in range(3)})
    before = snapshot(state)
    with pytest.raises(ValueError, match=match):
        state.release(slots)
    assert_unchanged(state, before)
    state.release(np.array([2], np.int64))  # ints of any integer kind are slot ids
    state.release(torch.tensor([1]))
    state.release(0)
    assert state.committed_lens.tolist() == [0, 0, 0]


# ---------------------------------------------------------------------------- silent coercions
@pytest.mark.parametrize("args, match", [
    (([True, 2], [0, 0], [0, 1]), "lens.*holds a bool"),
    (([1, 2], [0, False], [0, 1]), "context_lens.*holds a bool"),
    (([1, 2], [0, 0], [True, 0]), "slots.*holds a bool"),
    (([1], [0], np.array([True])), "bool array"),
    (([1], [0], [1.0]), "not a sequence of ints"),
])
def test_pack_refuses_bools_and_floats(args, match):
    with pytest.raises(ValueError, match=match):
        VerifyLayout.pack(*args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_requests=True, max_context=16), "max_requests=True"),
    (dict(max_requests=2, max_context=0), "max_context=0"),
    (dict(max_requests=2, max_context=16, page_size=0), "page_size=0"),
    (dict(max_requests=2, max_context=16, page_size=2.0), "page_size=2.0"),
    (dict(max_requests=2, max_context=16, max_step_tokens=0), "max_step_tokens=0"),
    (dict(max_requests=4, max_context=2 ** 40), r"max_context=1099511627776.*GiB"),
])
def test_new_state_refuses_bad_sizes(plain, kwargs, match):
    _, verifier = plain
    with pytest.raises(ValueError, match=match):
        verifier.new_state(**kwargs)


def test_capture_refuses_an_empty_tier_set_and_a_zero_block(plain):
    _, verifier = plain
    state = verifier.new_state(max_requests=2, max_context=16)
    with pytest.raises(ValueError, match=r"tiers=\(\)"):
        verifier.capture(state, tiers=(), progress=False)
    with pytest.raises(ValueError, match="block=0"):
        verifier.capture(state, block=0, progress=False)
    with pytest.raises(ValueError, match="non-empty sequence of Tier"):
        verifier.capture(state, tiers=((4, 2),), progress=False)
    assert verifier.session(state) is None


# ---------------------------------------------------------------------- raw errors, now named
@pytest.mark.parametrize("accept, match", [
    (None, "accept_lens is a NoneType"), ("ab", "accept_lens is a str"),
    (torch.ones(1, dtype=torch.int64, device="meta"), "accept_lens is a meta tensor"),
    ([True], "accept_lens.*holds a bool"), ([1.0], "accept_lens has dtype torch.float64"),
    (["a"], "not a sequence of ints"), ([[1]], "accept_lens has shape"),
])
def test_commit_names_a_bad_accept_lens(plain, accept, match):
    _, verifier = plain
    state = verifier.new_state(max_requests=2, max_context=16)
    layout = VerifyLayout.pack([2], [0], [0])
    verifier(tokens(2), layout, state)
    before = snapshot(state)
    with pytest.raises(ValueError, match=match):
        verifier.commit(layout, accept, state)
    with pytest.raises(ValueError, match="layout is a dict"):
        verifier.commit({"slots": [0]}, [1], state)
    assert_unchanged(state, before)


def test_a_state_made_under_inference_mode_serves_outside_it(plain):
    model, verifier = plain
    with torch.inference_mode():
        state = verifier.new_state(max_requests=2, max_context=16)
    assert not state.committed_lens.is_inference() and not state.kv_caches[0][0].is_inference()
    seq = tokens(3)
    layout = VerifyLayout.pack([3], [0], [0])
    with torch.inference_mode():
        got = verifier(seq, layout, state)
    verifier.commit(layout, [3], state)
    torch.testing.assert_close(got, full_logits(model, seq), rtol=1e-4, atol=1e-4)
    state.release([0])
    assert state.committed_lens.tolist() == [0, 0]


def test_ledger_rings_rule_and_its_bounded_memory():
    """A state with replay rings commits only its last forward (the rings hold one forward's
    rows); the ledger keeps the layouts of live steps only."""
    from dspark_compile.state import StepLedger

    ledger = StepLedger(max_requests=4)
    one, two = VerifyLayout.pack([2], [0], [0]), VerifyLayout.pack([3], [0], [1])
    for layout in (one, two):
        ledger.end(layout, ledger.begin(layout))
    ledger.check_commit(one, rings=False)  # KV only: slot 0's rows are still one's
    with pytest.raises(ProtocolError, match="replay rings"):
        ledger.check_commit(one, rings=True)
    ledger.check_commit(two, rings=True)
    for i in range(100):
        layout = VerifyLayout.pack([1], [i], [i % 4])
        ledger.end(layout, ledger.begin(layout))
    assert len(ledger._layouts) <= 33
    ledger.forget(np.arange(4))
    assert ledger.has_provisional().size == 0
