"""benchmarks/overlap_spike.py on the CPU (--smoke, Triton interpreter): both parts run on
their half batches and the JSON names them."""

import json

from helpers import load_benchmark


def test_smoke_runs_both_halves(tmp_path):
    spike = load_benchmark("overlap_spike")
    spike.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "overlap_spike_smoke.json").read_text())
    for bs in spike.SMOKE["batch_sizes"]:
        row = saved["results"][str(bs)]
        lens = spike.mix_lens(bs, spike.SMOKE["block"], spike.SMOKE["mean_len"],
                              spike.SMOKE["seed"])
        assert (row["tokens_a"], row["tokens_b"]) == (sum(lens[:bs // 2]), sum(lens[bs // 2:]))


def test_together_enqueues_every_part_after_the_current_work(monkeypatch):
    import contextlib

    import torch

    spike = load_benchmark("overlap_spike")
    calls = []

    class Stream:  # records the order of waits and runs
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append((self.name, "waits", other.name))

    here, a, b = Stream("here"), Stream("a"), Stream("b")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: here)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    spike._together([(a, lambda: calls.append("run a")), (b, lambda: calls.append("run b"))])()
    assert calls == [("a", "waits", "here"), ("b", "waits", "here"), "run a", "run b",
                     ("here", "waits", "a"), ("here", "waits", "b")]


def test_smoke_tiles_run_each_config_against_the_default(tmp_path):
    spike = load_benchmark("overlap_spike")
    spike.main(["--smoke", "--out", str(tmp_path), "--tiles", "32,4,3,128", "64,4,2,none"])
    saved = json.loads((tmp_path / "overlap_tiles_smoke.json").read_text())
    rows = saved["results"][str(spike.SMOKE["batch_sizes"][0])]
    assert [r["tiles"] for r in rows] == ["32,4,3,128", "64,4,2,none"]
    # another tile config only reorders the same sums: the output agrees with the default's
    assert all(r["max_abs_diff"] < 1e-3 for r in rows), rows
    cfg = spike.tile_config("64,8,4,none", "cpu")
    assert (cfg.attn_tile_n, cfg.attn_num_warps, cfg.attn_num_stages,
            cfg.attn_max_registers) == (64, 8, 4, None)
