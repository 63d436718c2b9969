"""The verify/commit protocol machine (``test_protocol_machine.py``) on recurrent hybrids.

A recurrent layer's committed state is not indexed by position the way a KV page is: a forward
reads it, the commit replays the accepted prefix into it, and nothing in the pools says which
forward wrote the replay rings. The same random mix of valid and invalid calls as the plain
decoder's machine (subsets of requests in any slot order, verifies with no commit, verifies of
stale layouts, commits of another forward's layout, releases, captures and drops of the static
session) runs here on a Gated DeltaNet hybrid (Qwen3.5) and a Mamba-2 hybrid (Bamba), each with
full-attention layers. Every accepted verify must equal HF's own forward over the request's
committed tokens plus the new ones; every refused call must leave the KV pools, the conv and
recurrent state, the replay rings, the committed lengths and the step ledger bitwise unchanged.
Fewer steps than the plain machine: HF's forward of a hybrid is slower on the CPU.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from dspark_compile import dspark_compile
from helpers import tiny_qwen35
from ssm_models import VOCAB as SSM_VOCAB, tiny_ssm
from test_protocol_machine import ProtocolMachine, one_thread  # noqa: F401 - a fixture

SETTINGS = settings(max_examples=30, stateful_step_count=50, derandomize=True, deadline=None,
                    database=None, suppress_health_check=list(HealthCheck))
GDN_VOCAB = 61


@functools.lru_cache(maxsize=None)
def gdn_hybrid():
    model = tiny_qwen35(seed=2, vocab=GDN_VOCAB)
    return model, dspark_compile(model)


@functools.lru_cache(maxsize=None)
def mamba2_hybrid():
    model = tiny_ssm("bamba", seed=2)
    return model, dspark_compile(model)


class GdnMachine(ProtocolMachine):
    VOCAB = GDN_VOCAB
    build = staticmethod(gdn_hybrid)


class StaticGdnMachine(GdnMachine):
    static = True


class Mamba2Machine(ProtocolMachine):
    VOCAB = SSM_VOCAB
    build = staticmethod(mamba2_hybrid)


@pytest.mark.parametrize("machine", [GdnMachine, StaticGdnMachine, Mamba2Machine],
                         ids=["gdn-eager", "gdn-static", "mamba2-eager"])
def test_protocol_state_machine_on_a_hybrid(machine, one_thread, fixed_draws):
    machine.stats.clear()
    _, verifier = machine.build()
    assert verifier.new_state(max_requests=1, max_context=8).linear is not None, \
        "the model has recurrent layers"
    run_state_machine_as_test(machine, settings=SETTINGS)
    stats = dict(machine.stats)
    assert stats["steps"] >= 1000 and stats["refused"] >= 300, stats
    assert stats["verified"] >= 100 and stats["committed"] >= 50, stats
    if machine.static:
        assert stats["verified on the session"] >= 40, stats
