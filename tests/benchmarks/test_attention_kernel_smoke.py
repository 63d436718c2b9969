"""benchmarks/attention_kernel.py --semantics on the CPU (--smoke, under the interpreter): the
script runs, checks each switch against the reference and writes its JSON."""

import json
import os

import pytest

from helpers import load_benchmark


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the smoke run interprets the kernels on the CPU")
def test_semantics_smoke_writes_every_case(tmp_path):
    bench = load_benchmark("attention_kernel")
    bench.main(["--smoke", "--semantics", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "attention_semantics.json").read_text())
    s = bench.SMOKE
    cases = [(r["case"], r["bs"]) for r in saved["rows"]]
    assert cases == [("window", b) for b in s["window_bs"]] + [
        (name, b) for b in s["switch_bs"] for name in ("softcap", "sinks", "softcap_sinks")]
    window = saved["rows"][0]
    assert window["windowed"]["kv_bytes"] < window["full"]["kv_bytes"]  # 23 keys, not 48
    assert window["windowed"]["plan"]["num_splits"] == window["full"]["plan"]["num_splits"]
    assert all(r["ratio"] > 0 for r in saved["rows"])
    assert saved["environment"]["triton"] and saved["settings"]["window"] == s["window"]
