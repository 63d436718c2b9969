"""benchmarks/moe_layer.py on the CPU (--smoke, Triton interpreter): every path agrees with the
reference and the JSON has every column the GPU run fills."""

import json

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
