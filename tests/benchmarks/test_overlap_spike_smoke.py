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
