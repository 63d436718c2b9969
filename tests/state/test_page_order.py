"""``new_state(page_order=...)``: a slot's pages a fixed permutation of the pool's (the default)
or one run of consecutive pages; both verify HF's rows, and any other order is refused by name
before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.specs import AttentionSpec
from dspark_compile.state.pools import PAGE_ORDERS, VerifierState
from helpers import Session, tiny_llama


def _table(order: str) -> torch.Tensor:
    specs = [AttentionSpec(2, 16), AttentionSpec(2, 16, window=5)]
    state = VerifierState.allocate(specs, 3, 40, 4, torch.float32, torch.device("cpu"),
                                   page_order=order)
    return state.block_table


def test_each_order_is_a_permutation_and_in_order_is_one_run_a_slot():
    shuffled, in_order = _table("shuffled"), _table("in_order")
    for table in (shuffled, in_order):
        assert table.shape == (3, 10)
        assert torch.equal(table.flatten().sort().values, torch.arange(30, dtype=torch.int32))
    assert torch.equal(in_order, torch.arange(30, dtype=torch.int32).view(3, 10))
    assert not torch.equal(shuffled, in_order)
    assert torch.equal(shuffled, _table("shuffled"))  # fixed, the same on every rank


@pytest.mark.parametrize("order", ["random", "", None, "IN_ORDER"])
def test_other_orders_are_refused_by_name(order):
    with pytest.raises(ValueError, match=r"page_order=.*must be one of 'shuffled', 'in_order'"):
        _table(order)


@pytest.mark.parametrize("order", PAGE_ORDERS)
def test_both_orders_verify_hfs_rows(order):
    model = tiny_llama(seed=1)
    verifier = dspark_compile(model)
    session = Session(model, verifier, [2, 0], max_context=64, seed=4, page_size=4,
                      page_order=order)
    session.vocab = 97
    session.step([6, 5], accept=[6, 5])
    for _ in range(6):
        session.step([session.rng.randint(1, 8) for _ in range(2)])
    assert session.max_err <= 1e-5, session.max_err
    assert (session.state.block_table[2, 1:] - session.state.block_table[2, :-1] == 1).all() \
        == (order == "in_order")
