"""Token tiers and the static-buffer replay path, on the CPU (the same code without capture)."""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.session.tiers import Tier, format_tiers, select_tier, tier_set
from helpers import PlainDecoder, full_logits


def test_tier_set_covers_every_uniform_width():
    tiers = tier_set(max_requests=6, block=4)
    for r in (2, 4, 6):
        for w in (1, 2, 3, 4):
            assert Tier(r * w, r) in tiers
    for w in (2, 3, 4):  # one request: a second, empty slot (no size-1 compile)
        assert select_tier(tiers, w, 1) == Tier(w, 2)
    assert not [t for t in tiers if t.request_slots == 1]
    assert Tier(1, 1) not in tiers and select_tier(tiers, 1, 1) == Tier(2, 2)
    assert [t.request_slots for t in tier_set(max_requests=1, block=4)] == [1, 1, 1], \
        "with one slot in all, the one-slot tiers stay"
    assert len(tiers) == len(set(tiers))
    assert "slots | tokens" in format_tiers(tiers)


@pytest.mark.parametrize("bad", [dict(max_requests=0, block=4), dict(max_requests=2, block=0),
                                 dict(max_requests=2, block=4, widths=(1, 2)),
                                 dict(max_requests=2, block=4, widths=(4, 5)),
                                 dict(max_requests=1, block=1)])
def test_bad_tier_sets_are_refused(bad):
    with pytest.raises(ValueError):
        tier_set(**bad)


def test_tier_geometry_is_respected():
    """192 requests x 1 token and 32 requests x 6 tokens never share a tier."""
    tiers = tier_set(max_requests=256, block=8)
    wide = select_tier(tiers, 192, 192)
    narrow = select_tier(tiers, 192, 32)
    assert wide.request_slots >= 192 and narrow.request_slots >= 32
    assert narrow != wide
    for _ in range(500):
        r = random.randint(1, 256)
        n = random.randint(r, 8 * r)
        t = select_tier(tiers, n, r)
        assert t.tokens >= n and t.request_slots >= r
        smaller = [x for x in tiers if x.fits(n, r) and (x.tokens, x.request_slots) <
                   (t.tokens, t.request_slots)]
        assert not smaller
    assert select_tier(tiers, 2049, 256) is None


def test_tier_rejects_impossible_geometry():
    with pytest.raises(ValueError, match="tokens >= request_slots"):
        Tier(3, 4)


@pytest.fixture(scope="module")
def plain():
    model = PlainDecoder(seed=5)
    return model, dspark_compile(model)


def test_static_buffer_path_matches_unpadded_and_own_forward(plain, caplog):
    model, verifier = plain
    eager_state = verifier.new_state(max_requests=8, max_context=64)
    tier_state = verifier.new_state(max_requests=8, max_context=64)
    reports = verifier.capture(tier_state, block=2).reports  # largest tier: 16 tokens, 8 slots
    assert reports == []  # nothing is captured on the CPU, but the static path is used
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    slots = [6, 1, 3]
    seqs = [torch.randint(0, 61, (n,), generator=gen) for n in (5, 3, 9)]
    for _ in range(2):
        for state in (eager_state, tier_state):
            layout = VerifyLayout.pack([5, 3, 9], [0, 0, 0], slots)
            verifier(torch.cat(seqs), layout, state)  # prefill: 17 tokens, past the largest tier
    warnings = [r for r in caplog.records if "past the largest tier" in r.getMessage()]
    assert len(warnings) == 1  # said once, not per call
    for state in (eager_state, tier_state):
        state.release(slots)
        verifier(torch.cat(seqs), layout, state)
        verifier.commit(layout, [5, 3, 9], state)
    context = [5, 3, 9]
    for _ in range(6):
        lens = [rng.randint(1, 2) for _ in slots]
        new = [torch.randint(0, 61, (n,), generator=gen) for n in lens]
        layout = VerifyLayout.pack(lens, context, slots)
        eager = verifier(torch.cat(new), layout, eager_state).clone()
        tiered = verifier(torch.cat(new), layout, tier_state)
        assert tiered.shape == eager.shape
        torch.testing.assert_close(tiered, eager, atol=1e-5, rtol=0)
        qsl = layout.query_start_loc.tolist()
        for i, n in enumerate(lens):
            want = full_logits(model, torch.cat([seqs[i], new[i]]))[-n:]
            torch.testing.assert_close(tiered[qsl[i]:qsl[i + 1]], want, atol=1e-5, rtol=0)
        accept = [rng.randint(1, n) for n in lens]
        for state in (eager_state, tier_state):
            verifier.commit(layout, accept, state)
        seqs = [torch.cat([s, t[:a]]) for s, t, a in zip(seqs, new, accept)]
        context = [c + a for c, a in zip(context, accept)]
    # Padding wrote no KV: both pools hold the same committed tokens.
    for (k1, v1), (k2, v2) in zip(eager_state.kv_caches, tier_state.kv_caches):
        for i, slot in enumerate(slots):
            rows = [int(eager_state.block_table[slot, p // 16]) * 16 + p % 16
                    for p in range(context[i])]
            torch.testing.assert_close(k1.flatten(0, 1)[rows], k2.flatten(0, 1)[rows],
                                       atol=1e-5, rtol=0)


def test_padded_rows_write_no_kv_and_attend_to_nothing(plain):
    model, verifier = plain
    state = verifier.new_state(max_requests=4, max_context=32)
    graphs = verifier.capture(state, block=4).graphs
    layout = VerifyLayout.pack([1, 2], [0, 0], [2, 0])
    before = [k.clone() for k, _ in state.kv_caches]
    verifier(torch.tensor([3, 4, 5]), layout, state)
    tier = select_tier(graphs.tiers, 3, 2)
    ids, qsl, ctx, slots, deltas = graphs.views(tier)
    assert qsl.tolist() == [0, 1, 3] + [3] * (tier.request_slots - 2)
    assert ids[3:].eq(0).all() and deltas.eq(0).all()
    meta = state.device_metadata(qsl, ctx, slots, tier.tokens)
    assert (meta["slot_mapping"][3:] == -1).all() and (meta["positions"][3:] == 0).all()
    written = sum(int((k != b).any(-1).any(-1).sum()) for (k, _), b in
                  zip(state.kv_caches, before))
    assert written == 3 * len(state.kv_caches)  # one pool row per real token per layer


def test_device_metadata_matches_host_layout(plain):
    _, verifier = plain
    state = verifier.new_state(max_requests=5, max_context=40)
    state.committed_lens[:] = torch.tensor([7, 0, 20, 3, 31], dtype=torch.int32)
    layout = VerifyLayout.pack([3, 1, 5], [20, 0, 31], [2, 1, 4])
    meta = state.device_metadata(layout.query_start_loc, layout.context_lens, layout.slots,
                                 layout.num_tokens)
    assert meta["positions"].tolist() == layout.positions.tolist()
    assert meta["slot_mapping"].tolist() == state.slot_mapping(layout).tolist()
    assert meta["seq_lens"].tolist() == layout.seq_lens.tolist()


def test_inductor_compiles_a_tier_set_once():
    """Token and request axes are marked dynamic before the first call and no tier has one
    request slot: one compile serves every tier, single requests included (automatic dynamic
    shapes compiled four times: static, then N, then R, then R = 1)."""
    from torch._dynamo.utils import counters

    from helpers import tiny_llama

    torch._dynamo.reset()
    counters.clear()
    verifier = dspark_compile(tiny_llama(layers=1), inductor=True)
    state = verifier.new_state(max_requests=8, max_context=64)
    session = verifier.capture(state, tiers=tier_set(8, 4), use_graphs=False)
    for tier in sorted(session.graphs.tiers, reverse=True):
        w = tier.tokens // tier.request_slots
        layouts = [VerifyLayout.pack([w] * tier.request_slots, [0] * tier.request_slots,
                                     list(range(tier.request_slots)))]
        if tier.request_slots == 2:
            layouts.append(VerifyLayout.pack([tier.tokens], [0], [3]))  # one request
        for layout in layouts:
            out = verifier(torch.zeros(layout.num_tokens, dtype=torch.int64), layout, state)
            assert torch.isfinite(out).all()
    assert counters["stats"]["unique_graphs"] == 1
