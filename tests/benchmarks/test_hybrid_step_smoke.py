"""benchmarks/hybrid_step.py end to end on the CPU (--smoke), and the shapes the GPU run uses."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dspark_compile.session.tiers import Tier, select_tier
from helpers import load_benchmark

TOL = 1e-4  # float32 reference ops against HF's forward (test_hybrid.py's tolerance)


@pytest.fixture(scope="module")
def hybrid_step():
    return load_benchmark("hybrid_step")


@pytest.fixture(scope="module")
def smoke(hybrid_step, tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid_step")
    returned = hybrid_step.main(["--smoke", "--out", str(out)])
    return returned, json.loads((out / "hybrid_step_smoke.json").read_text())


def test_smoke_json_has_every_column(hybrid_step, smoke):
    returned, saved = smoke
    s = hybrid_step.SMOKE
    assert "partial" not in saved and saved["settings"]["name"] == "smoke"
    assert saved["environment"]["torch"] == torch.__version__
    assert set(saved["results"]) == {str(bs) for bs in s.batches}
    for row in saved["results"].values():
        for key in ("ours_eager_mix3_ms", "ours_graph_mix3_ms", "ours_graph_uniform3_ms",
                    "ours_graph_all8_ms", "ours_commit_mix3_ms", "ours_commit_all8_ms",
                    "hf_dense8_eager_ms", "floor_mean3_ms", "floor_all8_ms"):
            assert row[key] > 0, key
        assert row["hf_dense8_graph_ms"] is None and "no CUDA" in row["hf_dense8_graph_error"]
    assert saved["capture"]["graphs"] is False
    assert saved["hf_cache_layers"] == ["LinearAttentionLayer", "StaticLayer"]
    gdn = saved["environment"]["hf_dense"]["gdn"]
    assert set(gdn["packages_installed"]) == {"fla", "causal_conv1d", "kernels"}
    if importlib.util.find_spec("matplotlib") is None:
        assert saved["png"] is None
    else:
        assert Path(saved["png"]).stat().st_size > 0
    assert saved["results"] == returned["results"]


def test_smoke_ragged_verify_equals_hf(smoke):
    _, saved = smoke
    assert saved["max_abs_err_vs_hf"] < TOL


@pytest.mark.parametrize("name", ["SMOKE", "QUICK", "FULL"])
def test_shapes_and_tiers(hybrid_step, name):
    """The mix has mean exactly 3 over lengths 1..8; every shape replays its own tier."""
    s = getattr(hybrid_step, name)
    tiers = hybrid_step.tiers_for(s)
    assert max(t.tokens for t in tiers) == max(s.batches) * s.block  # the rings' rows
    for bs in s.batches:
        shapes = hybrid_step.shapes_for(s, bs)
        assert sum(shapes["mix3"]) == 3 * bs and all(1 <= n <= 8 for n in shapes["mix3"])
        assert shapes == hybrid_step.shapes_for(s, bs)  # fixed seed
        for lens, want in ((shapes["mix3"], 3), (shapes["uniform3"], 3), (shapes["all8"], 8)):
            assert select_tier(tiers, sum(lens), bs) == Tier(max(2, want * bs), bs)
    if s.batches[-1] >= 64:
        assert len(set(hybrid_step.shapes_for(s, 64)["mix3"])) > 3  # a real mix


def test_full_config_is_qwen3_next_shaped(hybrid_step):
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(**hybrid_step.FULL.model)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    real = Qwen3NextConfig()  # HF's defaults are Qwen3-Next-80B-A3B's shapes
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "vocab_size"):
        assert getattr(cfg, key) == getattr(real, key), key
    # dense MLP as wide as the real model's active experts per token (10 routed + 1 shared)
    assert cfg.num_experts == 0
    assert cfg.intermediate_size == (real.num_experts_per_tok + 1) * real.moe_intermediate_size


@pytest.mark.parametrize("variant", ["moe", "a3b"])
def test_smoke_moe_variants_match_hf_and_count_active_experts(hybrid_step, variant, tmp_path):
    """The MoE variants run end to end (Qwen3-Next's experts, Qwen3-MoE's layer), exact against
    HF, and their floor reads only the experts a step's picks reach."""
    hybrid_step.main(["--smoke", "--variant", variant, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / f"hybrid_step_{variant}_smoke.json").read_text())
    assert saved["settings"]["variant"] == variant and saved["hf_experts"] == "eager"
    assert saved["max_abs_err_vs_hf"] <= TOL
    assert saved["params_per_token"] < saved["params"]
    s = hybrid_step.settings_for(hybrid_step.SMOKE, variant)
    every = hybrid_step.replace(s, model={**s.model, "num_experts": 0})  # no expert discount
    one = hybrid_step.floor_ms(s, saved["linear_params"], 1, 1)
    assert one < hybrid_step.floor_ms(every, saved["linear_params"], 1, 1)


def test_smoke_check_last_checks_after_the_timings(hybrid_step, tmp_path):
    """``--check-last`` times first and checks against HF at the end (its own file)."""
    hybrid_step.main(["--smoke", "--variant", "a3b", "--check-last", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "hybrid_step_a3b_smoke_check_last.json").read_text())
    assert saved["check_last"] is True and "partial" not in saved
    assert saved["max_abs_err_vs_hf"] <= TOL and saved["check_seconds"] > 0
    assert set(saved["results"]) == {str(bs) for bs in saved["settings"]["batches"]}
