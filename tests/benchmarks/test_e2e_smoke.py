"""benchmarks/e2e.py end to end on the CPU (--smoke), its synthetic drafter and rate model."""

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_compile.engine.drafter import SyntheticDrafter, per_draft_acceptance
from dspark_compile.session.tiers import select_tier, tier_set
from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable
from helpers import load_benchmark



@pytest.fixture(scope="module")
def e2e():
    return load_benchmark("e2e")


@pytest.fixture(scope="module")
def smoke(e2e, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    returned = e2e.main(["--smoke", "--out", str(out)])
    return returned, json.loads((out / "e2e_smoke.json").read_text())


def test_smoke_json_has_every_mode_and_concurrency(e2e, smoke):
    returned, saved = smoke
    s = e2e.SMOKE
    assert saved["settings"]["concurrency"] == [1, 4] and "partial" not in saved
    assert saved["sps_table"]["entries"] and saved["environment"]["torch"] == torch.__version__
    assert all(len(m["tokens_per_s_runs"]) == s.repeats == 3
               for row in saved["results"].values() for m in row["modes"].values())
    rate = e2e.TierRate(SpsTable.from_json(saved["sps_table"]), saved["planner"]["tiers"], 4)
    for c in (1, 4):  # the loop's time per step outside a replay, from no-speculation probes
        row = saved["results"][str(c)]
        probe = row["overhead_probe_seconds"]
        assert len(probe) == s.repeats and probe == sorted(probe)
        assert row["overhead_probe_steps"] == row["modes"]["none"]["steps"] == s.output
        replay_s = 1 / float(rate.steps_per_second(torch.tensor([c]), c)[0])
        want = min(max(0.0, probe[len(probe) // 2] / s.output - replay_s), 0.5)
        assert saved["results"][str(c)]["step_overhead_ms"] == pytest.approx(1e3 * want)
        assert 0.0 < row["rank_cost_ms"] < 1e3  # a ranking's host time, priced per c
        for mode in row["modes"].values():  # the runs in round order and by time
            assert sorted(mode["tokens_per_s_rounds"]) == sorted(mode["tokens_per_s_runs"])
        rounds = [row["modes"][m]["tokens_per_s_rounds"] for m in ("planner", row["best_fixed"])]
        want = float(np.median([p / f for p, f in zip(*rounds)]))
        assert row["targets"]["planner_over_best_fixed_paired"] == pytest.approx(want)
    assert set(saved["results"]) == {"1", "4"}
    for c, row in saved["results"].items():
        c = int(c)
        assert set(row["modes"]) == set(e2e.mode_names(s.gamma))
        for mode, r in row["modes"].items():
            for key in ("tokens_per_s", "mean_verify_tokens_per_step", "steps", "seconds",
                        "mean_tier_tokens_per_step"):
                assert r[key] > 0, (c, mode, key)
            assert r["decoded_tokens"] == c * s.output
            assert r["mean_tier_tokens_per_step"] >= r["mean_verify_tokens_per_step"]
            assert 0 <= r["mean_accepted"] <= s.gamma
        modes = row["modes"]
        assert modes["none"]["mean_verify_tokens_per_step"] == c  # every request, one token
        assert modes["none"]["steps"] == s.output and modes["none"]["mean_accepted"] == 0
        for w in range(2, s.gamma + 2):
            mode = "static" if w == s.gamma + 1 else f"fixed_{w}"
            assert modes[mode]["mean_verify_len_per_request"] == w
        assert modes["static"]["mean_accepted"] > 0  # the drafts were verified and kept
        assert row["best_fixed"] in {"static", *(f"fixed_{w}" for w in range(2, s.gamma + 1))}
        assert set(row["targets"]) == {"planner_over_none", "planner_over_best_fixed",
                                       "planner_over_best_fixed_paired", "meets_none",
                                       "meets_best_fixed"}
    if importlib.util.find_spec("matplotlib") is None:
        assert saved["png"] is None
    else:
        assert Path(saved["png"]).stat().st_size > 0
    assert saved["table_markdown"] == returned["table_markdown"]
    assert saved["table_markdown"].count("\n") == 1 + len(saved["results"])


def test_smoke_outputs_are_lossless(smoke):
    _, saved = smoke
    assert saved["lossless"] is True
    for row in saved["results"].values():
        assert {r["mismatched_tokens"] for r in row["modes"].values()} == {0}
        assert len({r["output_sha1"] for r in row["modes"].values()}) == 1


def test_random_target_decodes_hf_greedy_in_every_mode(e2e):
    """The plain random Llama (context matters to every token): every mode equals HF's own
    greedy decoding of the prompt."""
    s = replace(e2e.SMOKE, target="random", concurrency=(3,), output=6, warmup_output=2)
    _, outputs = e2e.run_benchmark(s)
    model, _ = e2e.build_target(s)
    prompts = outputs[3]["prompts"]
    want = []
    with torch.no_grad():
        for prompt in prompts:
            seq = prompt.clone()
            for _ in range(1 + s.output):  # the prefill's token, then the decoded ones
                seq = torch.cat([seq, model(seq[None]).logits[0, -1].argmax().view(1)])
            want.append(seq[s.context + 1:].tolist())
    assert outputs[3]["reference"].tolist() == want  # ReferenceEngine's plain greedy decode
    for mode in e2e.mode_names(s.gamma):
        assert outputs[3][mode].tolist() == want, mode


def test_successor_target_greedy_is_its_permutation(e2e):
    model, perm = e2e.build_target(e2e.SMOKE)
    seq = torch.randint(0, e2e.SMOKE.model["vocab_size"], (2, 40),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(seq).logits  # [2, 40, V]
    top = logits.topk(2, dim=-1)
    assert torch.equal(top.indices[..., 0], perm[seq])
    assert (top.values[..., 0] - top.values[..., 1]).min() > 1.0  # robust to summation order


def test_per_draft_acceptance_solves_the_mean():
    for gamma, mean in ((7, 3.0), (3, 0.5), (1, 0.25)):
        mu = per_draft_acceptance(mean, gamma)
        assert sum(mu ** j for j in range(1, gamma + 1)) == pytest.approx(mean, abs=1e-9)
    for bad in ((7, 7.0), (7, 0.0), (0, 0.5)):
        with pytest.raises(ValueError, match="mean_accepted"):
            per_draft_acceptance(bad[1], bad[0])


def test_synthetic_drafter_is_calibrated_and_hits_the_mean():
    gamma, vocab = 7, 50
    reference = np.random.default_rng(0).integers(0, vocab, (64, 400))
    drafter = SyntheticDrafter(reference, gamma, 3.0, 2.0, vocab, seed=1)
    rids = np.repeat(np.arange(64), 390)
    counts = np.tile(np.arange(1, 391), 64)
    tokens, conf = drafter.draft(rids, counts)
    right = tokens == reference[rids[:, None], counts[:, None] + np.arange(gamma)]
    accepted = np.cumprod(right, axis=1).sum(axis=1)
    assert accepted.mean() == pytest.approx(3.0, abs=0.05)
    assert conf.dtype == np.float32 and ((conf >= 0) & (conf <= 1)).all()
    for lo in (0.0, 0.5, 0.9):  # P(right | confidence) = confidence
        band = (conf >= lo) & (conf < lo + 0.1)
        assert right[band].mean() == pytest.approx(conf[band].mean(), abs=0.02)
    again = SyntheticDrafter(reference, gamma, 3.0, 2.0, vocab, seed=1)
    assert np.array_equal(again.draft(rids, counts)[0], tokens)  # seeded


def test_synthetic_drafter_refuses_bad_inputs():
    ref = np.zeros((2, 10), np.int64)
    with pytest.raises(ValueError, match="int64"):
        SyntheticDrafter(ref.astype(np.int32), 3, 1.0, 2.0, 8, 0)
    with pytest.raises(ValueError, match="concentration"):
        SyntheticDrafter(ref, 3, 1.0, 0.0, 8, 0)
    drafter = SyntheticDrafter(ref, 3, 1.0, 2.0, 8, 0)
    with pytest.raises(ValueError, match="counts"):
        drafter.draft(np.array([0]), np.array([8]))  # drafts 8..10 run past the reference


def test_tier_rate_charges_the_tier_a_step_replays(e2e):
    tiers = tier_set(8, 4)
    table = SpsTable(SpsMetadata(gpu="synthetic", model="tiny"), tuple(
        SpsEntry(t.tokens, 1000.0 / (1 + t.tokens + 0.1 * t.request_slots), t.request_slots)
        for t in sorted(tiers, key=lambda t: (t.request_slots, t.tokens))))
    rate = e2e.TierRate(table, tiers, max_requests=8)
    for requests in range(1, 9):
        span = rate.rate_span(requests, 3 * requests + 1, requests)  # B = R .. 4R
        for k, b in enumerate(range(requests, 4 * requests + 1)):
            tier = select_tier(tiers, b, requests)
            want = 1000.0 / (1 + tier.tokens + 0.1 * tier.request_slots)
            assert span[k].item() == pytest.approx(want)
            assert rate.steps_per_second(torch.tensor([b]), requests)[0].item() == \
                pytest.approx(want)
    # the table floors B = 5 (2 requests) to its 4-token point; the step replays (6, 2)
    assert table.steps_per_second(torch.tensor([5]), 2).item() > rate.rate_span(5, 1, 2).item()


def _pack_before(s, rids, e, lens, drafts, tokens):
    """Decoder._pack as it was before its fast path (the oracle)."""
    from dspark_compile import VerifyLayout

    block = np.concatenate([tokens[rids, e - 1][:, None], drafts], 1)
    layout = VerifyLayout.pack(torch.from_numpy(lens), torch.from_numpy(
        (s.context + e - 1).astype(np.int32)), torch.from_numpy(rids.astype(np.int32)))
    return layout, torch.from_numpy(block[np.arange(s.gamma + 1) < lens[:, None]])


def _emit_before(gamma, rids, e, drafts, acc, nxt, counts, tokens):
    """Decoder._emit's token writes as they were (a mask of the accepted drafts)."""
    emit = np.concatenate([drafts, np.zeros((rids.size, 1), np.int64)], 1)
    emit[np.arange(rids.size), acc] = nxt
    keep = np.arange(gamma + 1) <= acc[:, None]
    tokens[np.repeat(rids, acc + 1), (e[:, None] + np.arange(gamma + 1))[keep]] = emit[keep]
    counts[rids] += acc + 1


@pytest.fixture(scope="module")
def loop_host():
    """benchmarks/loop_host.py and its decoder (e2e.py's, over a tiny verifier) for 16."""
    module = load_benchmark("loop_host")
    return module, module.build(16)


@pytest.mark.parametrize("width", [None, 8])  # ragged (the planner) and the full block
def test_pack_and_emit_match_the_masked_versions(loop_host, width):
    """Over many steps of random lengths, acceptances and finished requests: the same layout,
    ids, emitted tokens (every column below a request's count) and counts as before."""
    module, decoder = loop_host
    s, g, c, output = decoder.s, decoder.s.gamma, 16, 60
    rng = np.random.default_rng(0 if width is None else width)
    run = module.e2e.Run(np.zeros((c, output + g + 2), np.int64))
    run.tokens[:, 0] = rng.integers(0, 64, c)
    old_tokens, counts, old_counts = run.tokens.copy(), np.ones(c, np.int64), np.ones(c, np.int64)
    while (rids := np.flatnonzero(counts < 1 + output)).size:
        r, e = rids.size, counts[rids]
        drafts = rng.integers(0, 64, (r, g))
        lens = np.full(r, width, np.int32) if width else rng.integers(1, g + 2, r).astype(
            np.int32)
        layout, ids = decoder._pack(rids, e, lens, drafts, run.tokens)
        old_layout, old_ids = _pack_before(s, rids, e, lens, drafts, old_tokens)
        for field in ("query_start_loc", "context_lens", "slots"):
            assert torch.equal(getattr(layout, field), getattr(old_layout, field))
        assert torch.equal(ids, old_ids)
        acc = np.minimum(rng.integers(0, g + 1, r), lens - 1).astype(np.int64)
        nxt = rng.integers(0, 64, r)
        decoder._emit(rids, e, layout, drafts, acc, nxt, counts, run)
        _emit_before(g, rids, e, drafts, acc, nxt, old_counts, old_tokens)
        assert np.array_equal(counts, old_counts)
        for i in range(c):
            assert np.array_equal(run.tokens[i, :counts[i]], old_tokens[i, :counts[i]])
    assert run.verify_tokens == sum(n for n, _ in run.shapes) and run.steps == len(run.shapes)


def test_output_and_repeats_flags_set_the_run_and_name_the_files(e2e):
    s, _ = e2e.parse_settings(["--smoke", "--output", "40", "--repeats", "5"])
    assert (s.output, s.repeats) == (40, 5)
    assert s.name == "smoke_output40_repeats5"
    default, _ = e2e.parse_settings(["--smoke"])
    assert (default.output, default.repeats, default.name) == (16, 3, "smoke")
    with pytest.raises(SystemExit):
        e2e.parse_settings(["--smoke", "--repeats", "0"])
