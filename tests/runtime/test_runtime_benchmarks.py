"""The runtime's benchmark scripts on the CPU: benchmarks/width_decisions.py on the synthetic
table (the MI355X shape of test_runtime_width.py) and benchmarks/runtime_device.py --smoke."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_benchmark
from test_runtime_width import MI355X_HAZARDS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def width_decisions(tmp_path_factory):
    pytest.importorskip("matplotlib")
    module = load_benchmark("width_decisions")
    out = tmp_path_factory.mktemp("width_decisions")
    module.main(["--synthetic-only", "--out", str(out)])
    return module, out


def test_synthetic_table_gives_the_mi355x_widths(width_decisions):
    module, out = width_decisions
    assert tuple(module.MI355X_HAZARDS) == tuple(MI355X_HAZARDS)  # the width test's profile
    data = json.loads((out / "width_decisions_synthetic.json").read_text())
    assert data["synthetic"] is True and data["batch_sizes"] == list(range(1, 257))
    widths = data["profiles"]["collapse after 5 (MI355X shape)"]["width"]
    got = {bs: widths[bs - 1] for bs in (1, 2, 4, 8, 64, 128, 256)}
    assert got == {1: 6, 2: 6, 4: 6, 8: 6, 64: 4, 128: 3, 256: 3}
    assert got == module.MI355X_BEST


def test_decisions_never_lose_to_the_full_width(width_decisions):
    _, out = width_decisions
    data = json.loads((out / "width_decisions_synthetic.json").read_text())
    assert len(data["profiles"]) >= 4
    for name, p in data["profiles"].items():
        assert all(1 <= w <= 8 for w in p["width"]), name
        assert min(p["relative_tokens_per_s"]) >= 1.0, name  # a fresh policy takes the argmax
    # Widths shrink with the batch: at bs 256 no profile verifies more than at bs 1.
    assert all(p["width"][-1] <= p["width"][0] for p in data["profiles"].values())
    for png in ("width_decisions_synthetic.png", "sps_curve_synthetic.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runtime_device_smoke(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "runtime_device.py"), "--smoke"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "runtime_device_smoke.json").read_text())
    assert data["environment"]["smoke"] and data["settings"]["gamma"] == 7
    assert [row["requests"] for row in data["results"]] == [1, 8]
    for row in data["results"]:
        assert row["check"]["device_plan_equals_host"]
        for call in ("planner", "feature_predict", "observe", "step"):
            assert row[call]["eager_us"] > 0 and row[call]["graph_us"] is None
            assert row[call]["graph_share_pct"] is None  # no shares from interpreter times
    assert data["verify_step_source"]
