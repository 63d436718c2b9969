"""A capture that guards on ``bs`` or ``T`` is refused at the model's line that made the guard,
also when the guard was raised inside torch (an op's fake kernel), never at a torch file.

Jamba's selective scan loops over ``range(seq_len)`` (its own line fixes ``T``); LFM2's and
Jamba's conv1d make torch's convolution pick a kernel by batch size (``bs < 16`` inside
``fake_impls.py``), which :mod:`dspark_compile.frontend.guards` traces back to the model line
that called the convolution.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from dspark_compile import dspark_compile
from dspark_compile.frontend.capture import SAMPLE_BS, SAMPLE_T, _check_guards, _token_symbols
from dspark_compile.graph_inputs import InputSpec, fake_input, name_placeholders
from dspark_compile.nn import CachedAttention

TORCH_FILES = re.compile(r"_subclasses|fake_impls|_decomp|_refs|torch/nn/")


class Mixer(nn.Module):
    def __init__(self, mix):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=2, groups=16)
        self.qkv = nn.Linear(16, 48)
        self.attn = CachedAttention(2, 2, 8)
        self.head = nn.Linear(16, 11)
        self.mix = mix

    def forward(self, ids, positions):
        x = self.mix(self, self.embed(ids))
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).unbind(2)
        return self.head(self.attn(q, k, v).flatten(2))


def branch_on_tokens(self, x):
    if x.shape[1] > 4:  # a Python branch on T
        return x * 2
    return x


def conv_over_tokens(self, x):
    return self.conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


def test_a_python_branch_on_t_is_refused_at_its_line():
    with pytest.raises(RuntimeError) as info:
        dspark_compile(Mixer(branch_on_tokens))
    message = str(info.value)
    assert re.search(r"guard T > 4 at \S*test_shape_guard_lines\.py:\d+ in branch_on_tokens: "
                     r"if x\.shape\[1\] > 4:", message), message


def test_a_guard_inside_torch_is_refused_at_the_op_models_line():
    """torch's convolution picks a kernel by batch size; the guard names the model's line."""
    with pytest.raises(RuntimeError) as info:
        dspark_compile(Mixer(conv_over_tokens))
    message = str(info.value)
    assert re.search(r"guard .*bs.* at \S*test_shape_guard_lines\.py:\d+ in forward: "
                     r"x = self\.mix\(self, self\.embed\(ids\)\) \(raised inside torch by "
                     r"aten\.convolution", message), message
    assert not TORCH_FILES.search(message), message


# ---------------------------------------------------------------- Jamba and LFM2
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _jamba():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.JambaForCausalLM(tf.JambaConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
        mamba_dt_rank=8)).eval()
    model.set_experts_implementation("batched_mm")  # as the capture runs experts
    return model


def _lfm2():
    import transformers as tf

    torch.manual_seed(0)
    return tf.Lfm2ForCausalLM(tf.Lfm2Config(
        **SMALL, layer_types=["conv", "full_attention"])).eval()


def _trace_hf(model):
    """HF's own forward traced as the capture traces (fake symbolic ``[bs, T]`` ids, stack
    traces recorded), without the frontend's adapters: the graph and its shape environment."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    ids = fake_input(mode, torch.zeros(SAMPLE_BS, SAMPLE_T, dtype=torch.long), "input_ids",
                     (0, 1))

    def forward(input_ids):
        return model(input_ids, use_cache=False).logits

    with torch.no_grad(), mode, enable_python_dispatcher():
        gm = make_fx(forward, tracing_mode="real", record_stack_traces=True)(ids)
    name_placeholders(gm, [InputSpec("input_ids", "input_ids")])
    return gm, mode.shape_env


def test_jamba_scan_fixing_t_is_reported_at_its_line():
    gm, env = _trace_hf(_jamba())
    with pytest.raises(RuntimeError) as info:
        _token_symbols(gm, env)
    message = str(info.value)
    assert re.search(r"specialised its token count T to 5 .* guard Eq\(T, 5\) at "
                     r"transformers/models/jamba/modeling_jamba\.py:\d+ in \w+: for \w+ in "
                     r"range\(seq_len\)", message), message


def test_lfm2_conv_guard_is_reported_at_its_line():
    gm, env = _trace_hf(_lfm2())
    bs, tokens = _token_symbols(gm, env)
    with pytest.raises(RuntimeError) as info:
        _check_guards(env, bs, tokens, gm)
    message = str(info.value)
    assert re.search(r"guard bs < 16 at transformers/models/lfm2/modeling_lfm2\.py:\d+ in \w+: "
                     r".*conv.*\(raised inside torch by aten\.convolution", message), message


def test_jamba_compiles_past_its_scan_loop():
    """HF's Mamba-1 scan loops over the tokens (``for index in range(seq_len)``), a guard on T;
    the capture replaces the scan (``frontend/mamba.py``), so Jamba compiles with its mixer as
    a linear layer and no guard (its exactness: tests/frontend/test_mamba_hybrids.py)."""
    verifier = dspark_compile(_jamba())
    assert [s.kind for s in verifier.adapter.linear_specs] == ["ssd"]
