"""SPS tables: JSON round trip, validation naming the entry, floor lookup, the additive fit."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

from dspark_compile.runtime import (
    SPS_SCHEMA,
    AdditiveStepModel,
    SpsEntry,
    SpsMetadata,
    SpsSample,
    SpsTable,
    TierRate,
    fit_additive_model,
    table_from_samples,
)

META = SpsMetadata(gpu="NVIDIA H200", model="tiny-llama",
                   versions=(("torch", "2.11.0"), ("triton", "3.6.0")),
                   tiers=((8, 1), (64, 8), (256, 64)))


def _table(points, requests=None) -> SpsTable:
    return SpsTable(META, tuple(SpsEntry(b, s, requests) for b, s in points))


def _doc(entries) -> dict:
    return {"schema": SPS_SCHEMA,
            "metadata": {"gpu": "g", "model": "m", "versions": {"torch": "2.13"},
                         "tiers": [[8, 1]]},
            "entries": entries}


def test_json_round_trip_keeps_entries_and_metadata(tmp_path):
    table = SpsTable(META, (SpsEntry(1, 580.0), SpsEntry(8, 552.5), SpsEntry(64, 171.5)))
    path = tmp_path / "sps.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert data["schema"] == SPS_SCHEMA
    assert data["metadata"] == {"gpu": "NVIDIA H200", "model": "tiny-llama",
                                "versions": {"torch": "2.11.0", "triton": "3.6.0"},
                                "tiers": [[8, 1], [64, 8], [256, 64]]}
    loaded = SpsTable.load(path)
    assert loaded == table
    assert loaded.metadata.tiers == ((8, 1), (64, 8), (256, 64))


def test_lookup_floors_and_keeps_cliffs():
    # T=3 slower than T=8 at bs 256 on the H200: a cliff that interpolation would hide.
    table = _table([(2, 100.0), (8, 40.0), (16, 60.0), (64, 10.0)])
    tokens = torch.tensor([1, 2, 3, 7, 8, 9, 15, 16, 63, 64, 1000])
    got = table.steps_per_second(tokens, 1)
    want = torch.tensor([100, 100, 100, 100, 40, 40, 40, 60, 60, 10, 10], dtype=torch.float64)
    assert got.dtype == torch.float64
    assert torch.equal(got, want)


@pytest.mark.parametrize("first,count", [(1, 5), (0, 70), (5, 100), (64, 3), (200, 4)])
def test_rate_span_matches_lookup(first, count):
    table = _table([(2, 100.0), (8, 40.0), (16, 60.0), (64, 10.0)])
    span = table.rate_span(first, count, 1)
    assert span.shape == (count,)
    assert torch.equal(span, table.steps_per_second(torch.arange(first, first + count), 1))


def test_request_keyed_table_floors_requests_then_tokens():
    entries = (SpsEntry(4, 100.0, 1), SpsEntry(16, 90.0, 1),
               SpsEntry(16, 50.0, 8), SpsEntry(64, 20.0, 8))
    table = SpsTable(META, entries)
    b = torch.tensor([4, 16, 63, 64])
    assert table.steps_per_second(b, 1).tolist() == [100.0, 90.0, 90.0, 90.0]
    assert table.steps_per_second(b, 7).tolist() == [100.0, 90.0, 90.0, 90.0]
    assert table.steps_per_second(b, 8).tolist() == [50.0, 50.0, 50.0, 20.0]
    assert table.steps_per_second(b, 500).tolist() == [50.0, 50.0, 50.0, 20.0]
    assert torch.equal(table.rate_span(8, 60, 9), table.steps_per_second(torch.arange(8, 68), 9))


def test_tier_rate_prices_a_step_at_the_tier_it_replays():
    """B tokens over R requests cost the smallest tier holding both, not the measured point
    below B; past the largest tier (or more requests than any) the largest tiers price it."""
    entries = (SpsEntry(4, 100.0, 1), SpsEntry(8, 80.0, 1),
               SpsEntry(8, 60.0, 2), SpsEntry(16, 40.0, 2))
    table = SpsTable(META, entries)
    rate = TierRate(table, [(4, 1), (8, 1), (8, 2), (16, 2)], max_requests=3)
    b = torch.tensor([1, 4, 5, 8, 9, 16, 40])
    assert rate.steps_per_second(b, 1).tolist() == [100.0, 100.0, 80.0, 80.0, 40.0, 40.0, 40.0]
    assert table.steps_per_second(torch.tensor([5]), 1).tolist() == [100.0]  # the floor
    assert rate.steps_per_second(b, 2).tolist() == [60.0, 60.0, 60.0, 60.0, 40.0, 40.0, 40.0]
    assert rate.steps_per_second(b, 3).tolist() == rate.steps_per_second(b, 2).tolist()
    assert torch.equal(rate.rate_span(3, 20, 1), rate.steps_per_second(torch.arange(3, 23), 1))
    with pytest.raises(ValueError, match="at least one tier"):
        TierRate(table, [], max_requests=2)


def test_tier_rate_adds_the_loops_fixed_cost_per_step():
    """1 / SPS + overhead: 100 steps/s with 5 ms per step outside the replay is 66.7 steps/s,
    and the fixed cost shrinks the price gap between a short and a long verify."""
    entries = (SpsEntry(4, 100.0, 1), SpsEntry(8, 50.0, 1))
    table = SpsTable(META, entries)
    plain = TierRate(table, [(4, 1), (8, 1)], max_requests=1)
    loaded = TierRate(table, [(4, 1), (8, 1)], max_requests=1, step_overhead_s=0.005)
    b = torch.tensor([4, 8])
    assert loaded.steps_per_second(b, 1).tolist() == pytest.approx([1 / 0.015, 1 / 0.025])
    ratio = lambda r: (r.steps_per_second(b, 1)[0] / r.steps_per_second(b, 1)[1]).item()
    assert ratio(loaded) < ratio(plain) == pytest.approx(2.0)
    for bad in (-1e-3, 1.5, "5ms"):
        with pytest.raises(ValueError, match="step_overhead_s"):
            TierRate(table, [(4, 1)], max_requests=1, step_overhead_s=bad)


BAD_ENTRIES = [
    ([{"tokens": 1, "steps_per_second": 5.0}, {"tokens": 2, "steps_per_second": float("nan")}],
     "entries[1].steps_per_second"),
    ([{"tokens": 1, "steps_per_second": -1.0}], "entries[0].steps_per_second"),
    ([{"tokens": 1, "steps_per_second": 0}], "entries[0].steps_per_second"),
    ([{"tokens": 1, "steps_per_second": float("inf")}], "entries[0].steps_per_second"),
    ([{"tokens": 1, "steps_per_second": "9"}], "entries[0].steps_per_second"),
    ([{"tokens": 4, "steps_per_second": 5.0}, {"tokens": 4, "steps_per_second": 4.0}],
     "entries[1].tokens"),
    ([{"tokens": 8, "steps_per_second": 5.0}, {"tokens": 4, "steps_per_second": 4.0}],
     "entries[1].tokens"),
    ([{"tokens": 0, "steps_per_second": 5.0}], "entries[0].tokens"),
    ([{"tokens": 1 << 30, "steps_per_second": 5.0}], "entries[0].tokens"),
    ([{"tokens": 2.0, "steps_per_second": 5.0}], "entries[0].tokens"),
    ([{"tokens": True, "steps_per_second": 5.0}], "entries[0].tokens"),
    ([{"steps_per_second": 5.0}], "entries[0]"),
    ([{"tokens": 1, "steps_per_second": 5.0, "ms": 1}], "entries[0]"),
    ([{"tokens": 1, "steps_per_second": 5.0, "requests": 1},
      {"tokens": 2, "steps_per_second": 4.0}], "entries[1].requests"),
    ([{"tokens": 1, "steps_per_second": 5.0, "requests": 4},
      {"tokens": 2, "steps_per_second": 4.0, "requests": 2}], "entries[1].requests"),
    ([], "entries"),
]


@pytest.mark.parametrize("entries,where", BAD_ENTRIES)
def test_bad_entry_is_refused_by_name(tmp_path, entries, where):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_doc(entries)))
    with pytest.raises(ValueError) as err:
        SpsTable.load(path)
    assert f"{path}: {where}" in str(err.value)


@pytest.mark.parametrize("mutate,where", [
    (lambda d: d.update(schema="dspark_compile.sps_table/0"), "schema"),
    (lambda d: d.pop("metadata"), "lacks key"),
    (lambda d: d.update(extra=1), "unknown key"),
    (lambda d: d["metadata"].update(gpu=""), "metadata.gpu"),
    (lambda d: d["metadata"].update(versions={"torch": 2}), "metadata.versions"),
    (lambda d: d["metadata"].update(tiers=[[8]]), "metadata.tiers[0]"),
    (lambda d: d["metadata"].update(tiers=[[8, -1]]), "metadata.tiers[0][1]"),
])
def test_bad_schema_is_refused(tmp_path, mutate, where):
    doc = _doc([{"tokens": 1, "steps_per_second": 5.0}])
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"bad\.json") as err:
        SpsTable.load(path)
    assert where in str(err.value)


def test_pickle_file_is_refused_without_unpickling(tmp_path):
    path = tmp_path / "sps.pkl"
    path.write_bytes(pickle.dumps({"entries": [(1, 5.0)]}))
    with pytest.raises(ValueError, match="not valid JSON"):
        SpsTable.load(path)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match=r"SpsTable\[1\]\.tokens"):
        _table([(8, 1.0), (8, 2.0)])
    with pytest.raises(ValueError, match="steps_per_second"):
        _table([(8, math.nan)])


def test_table_from_samples_takes_the_median_per_point():
    samples = [SpsSample(8, 0.010), SpsSample(8, 0.500), SpsSample(8, 0.012),  # one preempted
               SpsSample(1, 0.004), SpsSample(1, 0.006), SpsSample(64, 0.020)]
    table = table_from_samples(samples, META)
    assert [e.tokens for e in table.entries] == [1, 8, 64]
    assert [e.steps_per_second for e in table.entries] == [1 / 0.005, 1 / 0.012, 1 / 0.020]
    assert table.metadata == META


def test_table_from_samples_keyed_by_requests_and_refusals():
    table = table_from_samples([(16, 0.02, 8), (16, 0.01, 1), (32, 0.04, 8)], META)
    assert [(e.requests, e.tokens) for e in table.entries] == [(1, 16), (8, 16), (8, 32)]
    with pytest.raises(ValueError, match=r"samples\[1\]\.seconds"):
        table_from_samples([(8, 0.01), (8, -0.01)], META)
    with pytest.raises(ValueError, match=r"samples\[1\]\.requests"):
        table_from_samples([(8, 0.01, 2), (8, 0.01)], META)
    with pytest.raises(ValueError, match="empty"):
        table_from_samples([], META)


# ------------------------------------------------------------------ additive model
TRUTH = AdditiveStepModel(bias=2e-3, request_knots=(1, 8, 64, 256),
                          request_seconds=(0.0, 1e-4, 9e-4, 2.5e-3),
                          token_knots=(1, 16, 128, 512, 2304),
                          token_seconds=(0.0, 2e-4, 5e-4, 3e-3, 1.4e-2))


def _pinned_runs(noise: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    samples = []
    for k in (0, 15, 127, 511):  # pinned budgets; B = R + k
        for r in (1, 8, 64, 256):
            for b in {r + k, r + 2 * k + 1}:
                sec = float(TRUTH.seconds(torch.tensor([b]), r)[0])
                sec *= 1.0 + noise * float(torch.randn((), generator=gen))
                samples.append((r, b, sec))
    return samples


def test_additive_fit_recovers_the_model_on_its_knots():
    fit = fit_additive_model(_pinned_runs(), request_knots=TRUTH.request_knots,
                             token_knots=TRUTH.token_knots)
    grid_r = [1, 3, 8, 30, 64, 200, 256, 400]
    tokens = torch.tensor([1, 5, 16, 100, 128, 300, 512, 2000, 2304, 5000])
    for r in grid_r:
        torch.testing.assert_close(fit.seconds(tokens, r), TRUTH.seconds(tokens, r),
                                   rtol=1e-9, atol=1e-12)
    assert fit.request_seconds[0] == 0.0 and fit.token_seconds[0] == 0.0


def test_additive_fit_with_noise_and_clamped_interpolation():
    fit = fit_additive_model(_pinned_runs(noise=0.01), request_knots=TRUTH.request_knots,
                             token_knots=TRUTH.token_knots)
    tokens = torch.tensor([2, 64, 700])
    torch.testing.assert_close(fit.steps_per_second(tokens, 32),
                               TRUTH.steps_per_second(tokens, 32), rtol=0.03, atol=0.0)
    # Clamped: beyond the last knot the model is flat, not extrapolated.
    far = fit.seconds(torch.tensor([2304, 10_000, 10**6]), 10**4)
    assert far[0] == far[1] == far[2]
    assert torch.equal(fit.rate_span(3, 4, 8), fit.steps_per_second(torch.arange(3, 7), 8))


def test_additive_fit_refuses_an_unidentifiable_run_set():
    one_budget = [(r, r + 8, 1e-3 * r) for r in (1, 2, 4, 8, 16)]
    with pytest.raises(ValueError, match="two pinned budgets"):
        fit_additive_model(one_budget)
    with pytest.raises(ValueError, match=r"samples\[0\]\.seconds"):
        fit_additive_model([(1, 2, float("nan"))])


def test_additive_model_refuses_non_positive_step_times():
    with pytest.raises(ValueError, match="every step time must be > 0"):
        AdditiveStepModel(bias=1e-3, request_knots=(1, 2), request_seconds=(0.0, -2e-3),
                          token_knots=(1,), token_seconds=(0.0,))
