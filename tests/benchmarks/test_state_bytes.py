"""benchmarks/state_bytes.py: the pools it counts are the ones allocate makes."""

from __future__ import annotations

import json

import state_bytes


def test_rings_shrink_the_windowed_models_and_the_json_says_so(tmp_path):
    data = state_bytes.main(["--context", "8192", "--step", "256", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "state_bytes.json").read_text())
    assert saved["rows"] == data["rows"] and len(saved["rows"]) == 2
    gemma = next(r for r in saved["rows"] if r["model"] == "gemma3_27b_like")
    # 62 layers x 16 KV heads x 128 x (K, V) x bf16 per token, full pools
    assert gemma["full_gib"] * 2**30 == 62 * 16 * 128 * 2 * 2 * 8192
    # rings: the 52 sliding layers keep ceil((1024 + 255) / 64) = 20 pages of 64
    assert gemma["rings_step256_gib"] * 2**30 == 16 * 128 * 2 * 2 * (10 * 8192 + 52 * 20 * 64)
    for row in saved["rows"]:
        assert row["full_over_rings_step256"] > 1.5
