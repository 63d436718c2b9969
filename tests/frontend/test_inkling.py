"""Inkling: relative position logits (each query's own logit per key distance), short
convolutions on K, V and both residual branches, and the log-scaled full layers.

``frontend/relative.py`` replaces ``InklingAttention.forward`` for the capture so that the
logits and the query scaling follow each token's own position (HF computes them from its cache
offsets, which a cache-less capture does not have); the logits reach
``dspark::ragged_attention`` as ``rel``. Every ragged logit row equals HF's forward over that
request's whole sequence alone over a prefill and four ragged rounds (float32, CPU, reference
ops), with contexts past the full layers' extent and the sliding layers' window; dropping or
shifting the logits, or leaving out the scaling, is caught; a changed source and a
``position_bias`` from any other module are refused by name.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from helpers import ragged_rounds_error, triton_rounds_error

inkling = pytest.importorskip("transformers.models.inkling.modeling_inkling")

VOCAB = 89
TOL = 1e-4


def tiny_inkling(n_floor=3, extent: int = 6):
    from transformers import InklingTextConfig

    torch.manual_seed(0)
    cfg = InklingTextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=5, d_rel=8,
        rel_extent=extent, log_scaling_n_floor=n_floor, log_scaling_alpha=0.5,
        layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["sparse", "dense"],
        intermediate_size=96, moe_intermediate_size=48, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2)
    model = inkling.InklingForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init (std 0.02) leaves the relative logits near zero
        for name, p in model.named_parameters():
            if "norm" not in name and p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def compiled():
    model = tiny_inkling()
    return model, dspark_compile(model)


def test_both_layers_take_relative_logits(compiled):
    _, verifier = compiled
    specs = verifier.adapter.specs
    assert [(s.window, s.relative) for s in specs] == [(5, 5), (0, 6)]
    assert "relative logits over 6 distances" in verifier.explain()
    rel = [n for n in verifier.graph_module.graph.nodes
           if "ragged_attention" in str(n.target) and len(n.args) > 14
           and n.args[14] is not None]
    assert len(rel) == 2


@pytest.mark.parametrize("slots,prompts", [([1, 0, 2], [7, 4, 9]), ([0], [11])])
def test_ragged_equals_hf_forward(compiled, slots, prompts):
    model, verifier = compiled
    err = ragged_rounds_error(model, verifier, slots, prompts, VOCAB, seed=5)
    assert err < TOL, f"max |ragged - HF| = {err}"


def test_without_log_scaling_and_with_a_long_extent_equals_hf_forward():
    model = tiny_inkling(n_floor=None, extent=64)
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err < TOL, f"max |ragged - HF| = {err}"


@pytest.mark.parametrize("mutation", ["drop", "shift", "no_scaling"])
def test_a_wrong_capture_is_caught(monkeypatch, mutation):
    """The check above can fail: logits dropped or one distance off, or the log scaling of
    the full layer's queries and logits left out, make the ragged rows differ from HF's."""
    from dspark_compile.frontend import adapters, relative

    real = relative.RelativeLogits
    if mutation == "drop":
        monkeypatch.setattr(relative, "RelativeLogits", lambda x: real(torch.zeros_like(x)))
    elif mutation == "shift":
        monkeypatch.setattr(relative, "RelativeLogits", lambda x: real(
            torch.cat([x[..., 1:], x[..., :1]], -1).contiguous()))
    monkeypatch.setattr(adapters, "RelativeLogits", real)
    model = tiny_inkling()
    if mutation == "no_scaling":
        forward = relative._forward
        monkeypatch.setattr(relative, "_forward", lambda self, *a, **k: forward(
            self, *a, **k) if self.is_sliding else _unscaled(forward, self, *a, **k))
    err = ragged_rounds_error(model, dspark_compile(model), [1, 0], [5, 8], VOCAB, seed=3)
    assert err > 1e-2, err


def _unscaled(forward, module, *args, **kwargs):
    floor = module.config.log_scaling_n_floor
    module.config.log_scaling_n_floor = None
    try:
        return forward(module, *args, **kwargs)
    finally:
        module.config.log_scaling_n_floor = floor


@pytest.mark.parametrize("cls", ["InklingAttention", "InklingRelativeLogits"])
def test_changed_source_is_refused(monkeypatch, cls):
    from dspark_compile.frontend import relative

    monkeypatch.setitem(relative.KNOWN_SOURCES, cls, frozenset())
    with pytest.raises(NotImplementedError,
                       match=r"InklingAttention 'model.layers.0.self_attn'.*refused rather than "
                             r"verified wrong"):
        dspark_compile(tiny_inkling())


def test_position_bias_from_another_module_is_refused(monkeypatch):
    """A tensor ``position_bias`` (what HF's own forward passes) is not understood: only the
    replaced forward's relative logits are."""
    from dspark_compile.frontend import relative
    import contextlib

    monkeypatch.setattr(relative, "relative_hooks", lambda model, names: contextlib.nullcontext())
    from dspark_compile.frontend import adapters

    monkeypatch.setattr(adapters, "relative_hooks",
                        lambda model, names: contextlib.nullcontext())
    with pytest.raises(NotImplementedError, match=r"passes position_bias=a tensor .* refused "
                                                  r"rather than verified wrong"):
        dspark_compile(tiny_inkling())


def test_replaced_forward_is_restored():
    before = inkling.InklingAttention.forward
    dspark_compile(tiny_inkling())
    assert inkling.InklingAttention.forward is before


@pytest.mark.gpu
def test_float32_on_gpu_through_triton_matches_hf():
    """The relative logits through the Triton attention kernel, on the GPU."""
    err = triton_rounds_error(tiny_inkling(), [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 2e-3, err


def test_float32_convolutions_of_a_bf16_model_keep_float32_states():
    """Inkling's short convolutions run in float32 in a bf16 model: their states are float32
    (the conv's input dtype, read at discovery), the rest of the model's state bf16."""
    from dspark_compile.state.linear import LinearPools

    model = tiny_inkling().to(torch.bfloat16)
    verifier = dspark_compile(model)
    specs = verifier.adapter.linear_specs
    assert specs and all(s.conv_dtype == torch.float32 for s in specs)
    pools = LinearPools.allocate(specs, [], 2, 8, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.float32 for p in pools.conv_states)
    err = ragged_rounds_error(model, verifier, [1, 0], [5, 8], VOCAB, seed=3)
    assert err < 0.25, err  # bf16 against HF's own bf16 forward


def test_conv_dtype_is_none_where_the_conv_runs_in_the_model_dtype():
    from helpers import tiny_qwen3_next

    verifier = dspark_compile(tiny_qwen3_next())
    assert verifier.adapter.linear_specs
    assert all(s.conv_dtype is None for s in verifier.adapter.linear_specs)
