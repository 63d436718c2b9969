"""benchmarks/dsv4_step.py end to end on the CPU (--smoke): a tiny DeepSeek-V4 (sliding, HCA and
CSA layers) through the reference lowering, and its HF baseline over a prefilled cache."""

import json

from helpers import load_benchmark

TOL = 1e-4  # float32 reference ops against HF's forward


def test_smoke_json_has_every_column_and_matches_hf(tmp_path):
    dsv4_step = load_benchmark("dsv4_step")
    dsv4_step.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "dsv4_step_smoke.json").read_text())
    assert "partial" not in saved and saved["settings"]["name"] == "smoke"
    assert saved["max_abs_err_vs_hf"] <= TOL
    assert set(saved["results"]) == {str(bs) for bs in dsv4_step.SMOKE.batches}
    for row in saved["results"].values():
        for key in ("ours_graph_mix3_ms", "ours_graph_all8_ms", "hf_dense8_eager_ms"):
            assert row[key] > 0, key
    types = saved["settings"]["model"]["layer_types"]
    assert {dsv4_step.HCA, dsv4_step.CSA, dsv4_step.SLIDING} <= set(types)
