"""benchmarks/moe_layer.py on the CPU (--smoke, Triton interpreter): every path agrees with the
reference and the JSON has every column the GPU run fills."""

import json
import os
import time

import torch

from helpers import load_benchmark


def test_smoke_json_has_every_path(tmp_path):
    from dspark_compile.kernels.targets import TARGETS

    moe_layer = load_benchmark("moe_layer")
    table = dict(TARGETS)
    returned = moe_layer.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "moe_layer_smoke.json").read_text())
    assert "errors" not in saved and saved["settings"]["name"] == "smoke"
    assert saved["environment"]["torch"] == torch.__version__
    assert set(saved["results"]) == {str(bs) for bs in moe_layer.SMOKE["batch_sizes"]}
    for row in saved["results"].values():
        assert row["tokens"] == 3 * row["bs"] and row["pairs"] == 2 * row["tokens"]
        assert row["floor_us"] > 0 and 0 < row["active_experts"] <= 8
        for path in moe_layer.PATHS:
            assert row[path]["eager_us"] > 0 and row[path]["max_err"] < 1e-4, path
        assert row["experts_kernel_pick"] in ("triton", "grouped_mm")
    assert saved["results"] == returned["results"]
    assert TARGETS == table, "the benchmark restores the target table"


def test_timeline_sums_kernels_and_gaps():
    moe_layer = load_benchmark("moe_layer")
    # two calls of two kernels: a 1 us gap, an overlap of 0.5 us, then a 2 us gap
    spans = [("a", 0.0, 3.0), ("b", 4.0, 6.0), ("a", 5.5, 8.5), ("b", 10.5, 12.5)]
    t = moe_layer._timeline(spans, calls=2)
    assert t["kernels"]["a"] == dict(us_per_call=3.0, launches_per_call=1.0)
    assert t["kernels"]["b"] == dict(us_per_call=2.0, launches_per_call=1.0)
    assert t["busy_us_per_call"] == 5.0 and t["span_us_per_call"] == 6.25
    assert t["gap_us_per_call"] == (1.0 - 0.5 + 2.0) / 2 and t["kernels_seen"] == 4
    assert moe_layer._timeline([], calls=1)["span_us_per_call"] is None


def test_smi_rows_parse_nvidia_smi_csv(tmp_path):
    moe_layer = load_benchmark("moe_layer")
    path = tmp_path / "smi.csv"
    path.write_text("2026/12/02 16:50:01.123, 1980 MHz, 2619 MHz, 650.25 W, 51, 0x0000000000000000\n"
                    "2026/12/02 16:50:01.143, 1755 MHz, 2619 MHz, 699.90 W, 53, 0x0000000000000004\n"
                    "garbled line\n"
                    "2026/12/02 16:50:01.163, [N/A], 2619 MHz, [N/A], 53, 0x0\n")
    rows = moe_layer._smi_rows(str(path))
    assert [r["sm_mhz"] for r in rows] == [1980.0, 1755.0, None]
    assert rows[1]["power_w"] == 699.9 and rows[1]["temp_c"] == 53.0
    assert rows[1]["throttle"] == "0x0000000000000004" and rows[2]["power_w"] is None


def test_smi_sampling_collects_what_nvidia_smi_prints(tmp_path, monkeypatch):
    """The sampler runs ``nvidia-smi`` (here a stand-in script on PATH) for the block and
    hands back its parsed lines; off, or without ``nvidia-smi``, the list stays empty."""
    moe_layer = load_benchmark("moe_layer")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    "echo '2026/12/02 16:50:01.123, 1980 MHz, 2619 MHz, 650.25 W, 51, 0x0'\n"
                    "echo '2026/12/02 16:50:01.143, 1305 MHz, 2619 MHz, 703.10 W, 53, 0x4'\n"
                    "sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with moe_layer._smi_sampling() as rows:
        time.sleep(1.0)  # let the script print before it is stopped
        assert rows == [], "filled only once the block ends"
    assert [r["sm_mhz"] for r in rows] == [1980.0, 1305.0]
    assert rows[1]["power_w"] == 703.1 and rows[1]["throttle"] == "0x4"
    with moe_layer._smi_sampling(enabled=False) as off:
        pass
    assert off == []
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with moe_layer._smi_sampling() as missing:
        pass
    assert missing == []


def test_expert_loop_reference_matches_the_oracle():
    """The benchmark's check (expert by expert, float32) against the library's oracle (a
    float32 copy of each pair's weights), with and without padding rows past
    ``query_start_loc``."""
    moe_layer = load_benchmark("moe_layer")
    s = dict(moe_layer.SMOKE, experts=6, top_k=3)
    experts = moe_layer.build(s, "cpu")
    x, ids, weights, qsl = moe_layer.routing(29, s, "cpu")
    for bound in (qsl, torch.tensor([0, 17], dtype=torch.int32)):
        want = moe_layer.gathered_reference(experts, x, ids, weights, bound)
        got = moe_layer.reference(experts, x, ids, weights, bound)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if int(bound[-1]) < x.shape[0]:
            assert got[int(bound[-1]):].abs().max() == 0
