"""VerifyLayout and state validation: every bad input is a ValueError naming the rule."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dspark_compile import VerifyLayout
from dspark_compile.state.pools import AttentionSpec, VerifierState


def make_state(max_requests=4, max_context=32):
    return VerifierState.allocate([AttentionSpec(2, 8)], max_requests, max_context, 8,
                                  torch.float32, torch.device("cpu"))


def verified(state, layout):
    """Record a forward of ``layout`` in the state's step ledger, as ``Verifier`` does."""
    state.steps.end(layout, state.steps.begin(layout))
    return layout


def test_pack_builds_offsets_positions_and_request_ids():
    layout = VerifyLayout.pack(lens=[2, 1, 3], context_lens=[5, 0, 7], slots=[2, 0, 1])
    assert layout.query_start_loc.tolist() == [0, 2, 3, 6]
    assert layout.query_start_loc.dtype == torch.int32
    assert layout.positions.tolist() == [5, 6, 0, 7, 8, 9]
    assert layout.request_of_token.tolist() == [0, 0, 1, 2, 2, 2]
    assert layout.seq_lens.tolist() == [7, 1, 10]
    assert (layout.num_tokens, layout.num_requests) == (6, 3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(query_start_loc=[1, 3], context_lens=[0], slots=[0]), r"query_start_loc\[0\]=1"),
    (dict(query_start_loc=[0, 3, 2], context_lens=[0, 0], slots=[0, 1]), "length -1"),
    (dict(query_start_loc=[0, 3, 3], context_lens=[0, 0], slots=[0, 1]), "length 0"),
    (dict(query_start_loc=[0], context_lens=[], slots=[]), "at least one request"),
    (dict(query_start_loc=[0, 2], context_lens=[0, 1], slots=[0]), "context_lens has 2"),
    (dict(query_start_loc=[0, 2, 4], context_lens=[0, 0], slots=[1, 1]), "repeats a slot"),
    (dict(query_start_loc=[0, 2], context_lens=[-1], slots=[0]), "negative"),
    (dict(query_start_loc=[0, 2], context_lens=[0], slots=[-2]), "negative"),
    (dict(query_start_loc=torch.tensor([0, 2]), context_lens=[0], slots=[0]), "torch.int32"),
    (dict(query_start_loc=torch.tensor([[0, 2]], dtype=torch.int32), context_lens=[0],
          slots=[0]), "1-D"),
    (dict(query_start_loc=[0, 2.5], context_lens=[0], slots=[0]), None),
])
def test_bad_layouts_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VerifyLayout(**kwargs)


def test_length_below_one_in_pack():
    with pytest.raises(ValueError, match="must be >= 1"):
        VerifyLayout.pack(lens=[2, 0], context_lens=[0, 0], slots=[0, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_device_tensor_is_refused():
    with pytest.raises(ValueError, match="CPU tensor"):
        VerifyLayout(query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                     context_lens=[0], slots=[0])


def test_meta_device_tensor_is_refused():
    with pytest.raises(ValueError, match="CPU tensor"):
        VerifyLayout(query_start_loc=torch.empty(2, dtype=torch.int32, device="meta"),
                     context_lens=[0], slots=[0])


@pytest.mark.parametrize("layout_args, num_tokens, match", [
    (([3], [0], [0]), 4, "input_ids has 4 rows"),
    (([3], [0], [4]), 3, "slots must be < max_requests=4"),
    (([3], [30], [0]), 3, "exceeds the state's max_context=32"),
    (([1], [2], [0]), 1, "only 0 committed tokens"),
])
def test_layout_against_state(layout_args, num_tokens, match):
    layout = VerifyLayout.pack(*layout_args)
    with pytest.raises(ValueError, match=match):
        make_state().check_layout(layout, num_tokens)


def test_commit_rules():
    state = make_state()
    layout = verified(state, VerifyLayout.pack([3, 2], [0, 0], [1, 3]))
    with pytest.raises(ValueError, match=r"accept_lens\[0\]=4"):
        state.advance(layout, [4, 1])
    with pytest.raises(ValueError, match=r"accept_lens\[1\]=0"):
        state.advance(layout, [1, 0])
    with pytest.raises(ValueError, match="one entry per request"):
        state.advance(layout, [1])
    with pytest.raises(ValueError, match="integers"):
        state.advance(layout, torch.tensor([1.0, 1.0]))
    assert state.committed_lens.tolist() == [0, 0, 0, 0]  # nothing half-applied
    state.advance(layout, [2, 1])
    assert state.committed_lens.tolist() == [0, 2, 0, 1]
    with pytest.raises(ValueError, match="commit each step once"):
        state.advance(layout, [1, 1])


def test_slot_mapping_follows_the_block_table():
    state = make_state()
    layout = VerifyLayout.pack([3], [0], [2])
    state.committed_lens[2] = 0
    table = state.block_table[2].tolist()
    want = [table[0] * 8 + 0, table[0] * 8 + 1, table[0] * 8 + 2]
    assert state.slot_mapping(layout).tolist() == want
    state.committed_lens[2] = 7
    layout = VerifyLayout.pack([2], [7], [2])
    assert state.slot_mapping(layout).tolist() == [table[0] * 8 + 7, table[1] * 8 + 0]


ints = st.one_of(st.integers(-3, 40), st.just(2**31), st.floats(-1, 3))


@settings(max_examples=300, deadline=None)
@given(qsl=st.lists(ints, max_size=6), ctx=st.lists(ints, max_size=6),
       slots=st.lists(ints, max_size=6), num_tokens=st.integers(0, 50))
def test_random_layouts_raise_only_value_error(qsl, ctx, slots, num_tokens):
    state = make_state()
    try:
        layout = VerifyLayout(query_start_loc=qsl, context_lens=ctx, slots=slots)
        state.check_layout(layout, num_tokens)
    except ValueError:
        return
    # Whatever passed validation is a well-formed layout.
    assert layout.query_start_loc[0] == 0 and (layout.lens >= 1).all()
    assert layout.num_tokens == num_tokens
    assert (layout.seq_lens <= state.max_context).all()


def test_host_views_share_memory_with_the_fields():
    import numpy as np

    layout = VerifyLayout.pack(np.array([2, 1, 3], np.int32), np.array([5, 0, 7], np.int32),
                               np.array([2, 0, 1], np.int32))
    qsl, ctx, slots = layout.host
    assert qsl.tolist() == [0, 2, 3, 6] and ctx.tolist() == [5, 0, 7]
    assert slots.tolist() == [2, 0, 1]
    for view, field in zip(layout.host, (layout.query_start_loc, layout.context_lens,
                                         layout.slots)):
        assert view.dtype == np.int32 and view.ctypes.data == field.data_ptr()
    assert (layout.num_tokens, layout.num_requests) == (6, 3)


def test_int32_arrays_skip_the_range_check_and_wider_ones_keep_it():
    import numpy as np

    big = np.array([0, 2**31], np.int64)
    with pytest.raises(ValueError, match="does not fit in int32"):
        VerifyLayout(query_start_loc=big, context_lens=[0], slots=[0])
    layout = VerifyLayout(query_start_loc=np.array([0, 2], np.int64), context_lens=[0],
                          slots=np.array([3], np.uint8))
    assert layout.slots.dtype == torch.int32 and layout.slots.tolist() == [3]


@pytest.mark.parametrize("kind", ["list", "tensor", "numpy"])
def test_commit_takes_numpy_int64_like_any_integer_sequence(kind):
    import numpy as np

    def as_kind(values):
        return {"list": list(values), "tensor": torch.tensor(values),
                "numpy": np.array(values, np.int64)}[kind]

    state = make_state()
    layout = verified(state, VerifyLayout.pack([3, 2], [0, 0], [1, 3]))
    with pytest.raises(ValueError, match=r"accept_lens\[0\]=4"):
        state.advance(layout, as_kind([4, 1]))
    with pytest.raises(ValueError, match=r"accept_lens\[1\]=0"):
        state.advance(layout, as_kind([1, 0]))
    with pytest.raises(ValueError, match="one entry per request"):
        state.advance(layout, as_kind([1]))
    acc = state.advance(layout, as_kind([2, 1]))
    assert acc.dtype == torch.int64 and acc.tolist() == [2, 1]
    assert state.committed_lens.tolist() == [0, 2, 0, 1]
    with pytest.raises(ValueError, match="commit each step once"):
        state.advance(layout, as_kind([1, 1]))
