"""Snapshots of a Qwen3.5 Gated DeltaNet layer before and after the hybrid passes.

Only the linear-attention layer's section of the graph is shown (from its input projection to
its output projection): the rest is the attention and MLP the Llama snapshots already cover.
Regenerate with EXPECTTEST_ACCEPT=1, on the versions pinned in test_pass_snapshots.py.
"""

import pytest
import torch
import transformers
from expecttest import TestCase

from helpers import tiny_qwen35
from test_pass_snapshots import HF_SNAPSHOT_VERSION, TORCH_SNAPSHOT_VERSION, stages

pytestmark = [
    pytest.mark.skipif(not torch.__version__.startswith(TORCH_SNAPSHOT_VERSION),
                       reason=f"snapshots were taken on torch {TORCH_SNAPSHOT_VERSION}"),
    pytest.mark.skipif(transformers.__version__ != HF_SNAPSHOT_VERSION,
                       reason=f"snapshots were taken on transformers {HF_SNAPSHOT_VERSION}"),
]


def linear_layer_section(text: str) -> str:
    """The inputs line plus the GDN layer's lines (in_proj_qkv up to out_proj)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if "linear_attn_in_proj_qkv_weight)" in ln)
    end = next(i for i, ln in enumerate(lines) if "linear_attn_out_proj_weight)" in ln)
    return "\n".join([lines[0], *lines[start:end]])


class Qwen35LinearLayerSnapshots(TestCase):
    @classmethod
    def setUpClass(cls):
        texts = stages(tiny_qwen35(vocab=13, layer_types=("linear_attention",
                                                          "full_attention")))
        cls.texts = {k: linear_layer_section(v) for k, v in texts.items()}

    def test_before_ragged_conv(self):
        self.assertExpectedInline(self.texts["ragged_attention"], """\
inputs: input_ids[s0, s1], positions[s0, s1], block_table[s2, 2], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], slots[s3], conv_state_0[3, 128, 3], recurrent_state_0[3, 4, 16, 16], query_start_loc[s0 + 1], seq_lens[s0], slot_mapping[s0*s1]
t = aten.t(model_layers_0_linear_attn_in_proj_qkv_weight)  # [64, 128]
sym_size_int_2 = aten.sym_size(input_ids, 1)  # s1
mul_5 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view = aten.view(mul_4, [mul_5, 64])  # [s0*s1, 64]
mm = aten.mm(view, t)  # [s0*s1, 128]
_unsafe_view = aten._unsafe_view(mm, [sym_size_int_1, sym_size_int_2, 128])  # [s0, s1, 128]
transpose = aten.transpose(_unsafe_view, 1, 2)  # [s0, 128, s1]
t_1 = aten.t(model_layers_0_linear_attn_in_proj_z_weight)  # [64, 64]
mul_6 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_1 = aten.view(mul_4, [mul_6, 64])  # [s0*s1, 64]
mm_1 = aten.mm(view_1, t_1)  # [s0*s1, 64]
_unsafe_view_1 = aten._unsafe_view(mm_1, [sym_size_int_1, sym_size_int_2, 64])  # [s0, s1, 64]
view_2 = aten.view(_unsafe_view_1, [sym_size_int_1, sym_size_int_2, -1, 16])  # [s0, s1, 4, 16]
t_2 = aten.t(model_layers_0_linear_attn_in_proj_b_weight)  # [64, 4]
mul_7 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_3 = aten.view(mul_4, [mul_7, 64])  # [s0*s1, 64]
mm_2 = aten.mm(view_3, t_2)  # [s0*s1, 4]
_unsafe_view_2 = aten._unsafe_view(mm_2, [sym_size_int_1, sym_size_int_2, 4])  # [s0, s1, 4]
t_3 = aten.t(model_layers_0_linear_attn_in_proj_a_weight)  # [64, 4]
mul_8 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_4 = aten.view(mul_4, [mul_8, 64])  # [s0*s1, 64]
mm_3 = aten.mm(view_4, t_3)  # [s0*s1, 4]
_unsafe_view_3 = aten._unsafe_view(mm_3, [sym_size_int_1, sym_size_int_2, 4])  # [s0, s1, 4]
squeeze = aten.squeeze(model_layers_0_linear_attn_conv1d_weight, 1)  # [128, 4]
dense_causal_conv1d = dspark.dense_causal_conv1d(transpose, squeeze, None, conv_state_0, slots, 'silu')  # [s0, 128, s1]
transpose_1 = aten.transpose(dense_causal_conv1d, 1, 2)  # [s0, s1, 128]
split_with_sizes = aten.split_with_sizes(transpose_1, [32, 32, 64], -1)
getitem = getitem(split_with_sizes, 0)  # [s0, s1, 32]
getitem_1 = getitem(split_with_sizes, 1)  # [s0, s1, 32]
getitem_2 = getitem(split_with_sizes, 2)  # [s0, s1, 64]
view_5 = aten.view(getitem, [sym_size_int_1, sym_size_int_2, 2, 16])  # [s0, s1, 2, 16]
view_6 = aten.view(getitem_1, [sym_size_int_1, sym_size_int_2, 2, 16])  # [s0, s1, 2, 16]
view_7 = aten.view(getitem_2, [sym_size_int_1, sym_size_int_2, 4, 16])  # [s0, s1, 4, 16]
sigmoid = aten.sigmoid(_unsafe_view_2)  # [s0, s1, 4]
exp = aten.exp(model_layers_0_linear_attn_A_log)  # [4]
neg = aten.neg(exp)  # [4]
add_2 = aten.add(_unsafe_view_3, model_layers_0_linear_attn_dt_bias)  # [s0, s1, 4]
softplus = aten.softplus(add_2)  # [s0, s1, 4]
mul_9 = aten.mul(neg, softplus)  # [s0, s1, 4]
dense_gated_delta_rule = dspark.dense_gated_delta_rule(view_5, view_6, view_7, mul_9, sigmoid, recurrent_state_0, slots, 0.25, True)  # [s0, s1, 4, 16]
view_8 = aten.view(dense_gated_delta_rule, [-1, 16])  # [4*s0*s1, 16]
view_9 = aten.view(view_2, [-1, 16])  # [4*s0*s1, 16]
pow_1 = aten.pow(view_8, 2)  # [4*s0*s1, 16]
mean_1 = aten.mean(pow_1, [-1], True)  # [4*s0*s1, 1]
add_3 = aten.add(mean_1, 1e-06)  # [4*s0*s1, 1]
rsqrt_1 = aten.rsqrt(add_3)  # [4*s0*s1, 1]
mul_10 = aten.mul(view_8, rsqrt_1)  # [4*s0*s1, 16]
mul_11 = aten.mul(model_layers_0_linear_attn_norm_weight, mul_10)  # [4*s0*s1, 16]
silu = aten.silu(view_9)  # [4*s0*s1, 16]
mul_12 = aten.mul(mul_11, silu)  # [4*s0*s1, 16]
view_10 = aten.view(mul_12, [sym_size_int_1, sym_size_int_2, -1])  # [s0, s1, 64]""")

    def test_ragged_conv(self):
        self.assertExpectedInline(self.texts["ragged_conv"], """\
inputs: input_ids[s0, s1], positions[s0, s1], block_table[s2, 2], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], slots[s3], conv_state_0[3, 128, 3], recurrent_state_0[3, 4, 16, 16], query_start_loc[s0 + 1], seq_lens[s0], slot_mapping[s0*s1], conv_ring_0[16, 128]
t = aten.t(model_layers_0_linear_attn_in_proj_qkv_weight)  # [64, 128]
sym_size_int_1 = aten.sym_size(input_ids, 0)  # s0
sym_size_int_2 = aten.sym_size(input_ids, 1)  # s1
mul_5 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view = aten.view(mul_4, [mul_5, 64])  # [s0*s1, 64]
mm = aten.mm(view, t)  # [s0*s1, 128]
_unsafe_view = aten._unsafe_view(mm, [sym_size_int_1, sym_size_int_2, 128])  # [s0, s1, 128]
transpose = aten.transpose(_unsafe_view, 1, 2)  # [s0, 128, s1]
t_1 = aten.t(model_layers_0_linear_attn_in_proj_z_weight)  # [64, 64]
mul_6 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_1 = aten.view(mul_4, [mul_6, 64])  # [s0*s1, 64]
mm_1 = aten.mm(view_1, t_1)  # [s0*s1, 64]
_unsafe_view_1 = aten._unsafe_view(mm_1, [sym_size_int_1, sym_size_int_2, 64])  # [s0, s1, 64]
view_2 = aten.view(_unsafe_view_1, [sym_size_int_1, sym_size_int_2, -1, 16])  # [s0, s1, 4, 16]
t_2 = aten.t(model_layers_0_linear_attn_in_proj_b_weight)  # [64, 4]
mul_7 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_3 = aten.view(mul_4, [mul_7, 64])  # [s0*s1, 64]
mm_2 = aten.mm(view_3, t_2)  # [s0*s1, 4]
_unsafe_view_2 = aten._unsafe_view(mm_2, [sym_size_int_1, sym_size_int_2, 4])  # [s0, s1, 4]
t_3 = aten.t(model_layers_0_linear_attn_in_proj_a_weight)  # [64, 4]
mul_8 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_4 = aten.view(mul_4, [mul_8, 64])  # [s0*s1, 64]
mm_3 = aten.mm(view_4, t_3)  # [s0*s1, 4]
_unsafe_view_3 = aten._unsafe_view(mm_3, [sym_size_int_1, sym_size_int_2, 4])  # [s0, s1, 4]
squeeze = aten.squeeze(model_layers_0_linear_attn_conv1d_weight, 1)  # [128, 4]
mul_9 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
transpose_1 = aten.transpose(transpose, 1, 2)  # [s0, s1, 128]
view_5 = aten.view(transpose_1, [mul_9, 128])  # [s0*s1, 128]
causal_conv1d = dspark.causal_conv1d(view_5, squeeze, None, conv_state_0, query_start_loc, slots, conv_ring_0, 'silu')  # [s0*s1, 128]
view_6 = aten.view(causal_conv1d, [sym_size_int_1, sym_size_int_2, 128])  # [s0, s1, 128]
transpose_2 = aten.transpose(view_6, 1, 2)  # [s0, 128, s1]
transpose_3 = aten.transpose(transpose_2, 1, 2)  # [s0, s1, 128]
split_with_sizes = aten.split_with_sizes(transpose_3, [32, 32, 64], -1)
getitem = getitem(split_with_sizes, 0)  # [s0, s1, 32]
getitem_1 = getitem(split_with_sizes, 1)  # [s0, s1, 32]
getitem_2 = getitem(split_with_sizes, 2)  # [s0, s1, 64]
view_7 = aten.view(getitem, [sym_size_int_1, sym_size_int_2, 2, 16])  # [s0, s1, 2, 16]
view_8 = aten.view(getitem_1, [sym_size_int_1, sym_size_int_2, 2, 16])  # [s0, s1, 2, 16]
view_9 = aten.view(getitem_2, [sym_size_int_1, sym_size_int_2, 4, 16])  # [s0, s1, 4, 16]
sigmoid = aten.sigmoid(_unsafe_view_2)  # [s0, s1, 4]
exp = aten.exp(model_layers_0_linear_attn_A_log)  # [4]
neg = aten.neg(exp)  # [4]
add_2 = aten.add(_unsafe_view_3, model_layers_0_linear_attn_dt_bias)  # [s0, s1, 4]
softplus = aten.softplus(add_2)  # [s0, s1, 4]
mul_10 = aten.mul(neg, softplus)  # [s0, s1, 4]
dense_gated_delta_rule = dspark.dense_gated_delta_rule(view_7, view_8, view_9, mul_10, sigmoid, recurrent_state_0, slots, 0.25, True)  # [s0, s1, 4, 16]
view_10 = aten.view(dense_gated_delta_rule, [-1, 16])  # [4*s0*s1, 16]
view_11 = aten.view(view_2, [-1, 16])  # [4*s0*s1, 16]
pow_1 = aten.pow(view_10, 2)  # [4*s0*s1, 16]
mean_1 = aten.mean(pow_1, [-1], True)  # [4*s0*s1, 1]
add_3 = aten.add(mean_1, 1e-06)  # [4*s0*s1, 1]
rsqrt_1 = aten.rsqrt(add_3)  # [4*s0*s1, 1]
mul_11 = aten.mul(view_10, rsqrt_1)  # [4*s0*s1, 16]
mul_12 = aten.mul(model_layers_0_linear_attn_norm_weight, mul_11)  # [4*s0*s1, 16]
silu = aten.silu(view_11)  # [4*s0*s1, 16]
mul_13 = aten.mul(mul_12, silu)  # [4*s0*s1, 16]
view_12 = aten.view(mul_13, [sym_size_int_1, sym_size_int_2, -1])  # [s0, s1, 64]""")

    def test_ragged_linear_attention(self):
        self.assertExpectedInline(self.texts["ragged_linear_attention"], """\
inputs: input_ids[s0, s1], positions[s0, s1], block_table[s2, 2], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], slots[s3], conv_state_0[3, 128, 3], recurrent_state_0[3, 4, 16, 16], query_start_loc[s0 + 1], seq_lens[s0], slot_mapping[s0*s1], conv_ring_0[16, 128], gdn_ring_k_0[16, 2, 16], gdn_ring_v_0[16, 4, 16], gdn_ring_g_0[16, 4], gdn_ring_beta_0[16, 4]
t = aten.t(model_layers_0_linear_attn_in_proj_qkv_weight)  # [64, 128]
sym_size_int_1 = aten.sym_size(input_ids, 0)  # s0
sym_size_int_2 = aten.sym_size(input_ids, 1)  # s1
mul_5 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view = aten.view(mul_4, [mul_5, 64])  # [s0*s1, 64]
mm = aten.mm(view, t)  # [s0*s1, 128]
_unsafe_view = aten._unsafe_view(mm, [sym_size_int_1, sym_size_int_2, 128])  # [s0, s1, 128]
transpose = aten.transpose(_unsafe_view, 1, 2)  # [s0, 128, s1]
t_1 = aten.t(model_layers_0_linear_attn_in_proj_z_weight)  # [64, 64]
mul_6 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_1 = aten.view(mul_4, [mul_6, 64])  # [s0*s1, 64]
mm_1 = aten.mm(view_1, t_1)  # [s0*s1, 64]
_unsafe_view_1 = aten._unsafe_view(mm_1, [sym_size_int_1, sym_size_int_2, 64])  # [s0, s1, 64]
view_2 = aten.view(_unsafe_view_1, [sym_size_int_1, sym_size_int_2, -1, 16])  # [s0, s1, 4, 16]
t_2 = aten.t(model_layers_0_linear_attn_in_proj_b_weight)  # [64, 4]
mul_7 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_3 = aten.view(mul_4, [mul_7, 64])  # [s0*s1, 64]
mm_2 = aten.mm(view_3, t_2)  # [s0*s1, 4]
_unsafe_view_2 = aten._unsafe_view(mm_2, [sym_size_int_1, sym_size_int_2, 4])  # [s0, s1, 4]
t_3 = aten.t(model_layers_0_linear_attn_in_proj_a_weight)  # [64, 4]
mul_8 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
view_4 = aten.view(mul_4, [mul_8, 64])  # [s0*s1, 64]
mm_3 = aten.mm(view_4, t_3)  # [s0*s1, 4]
_unsafe_view_3 = aten._unsafe_view(mm_3, [sym_size_int_1, sym_size_int_2, 4])  # [s0, s1, 4]
squeeze = aten.squeeze(model_layers_0_linear_attn_conv1d_weight, 1)  # [128, 4]
mul_9 = mul(sym_size_int_1, sym_size_int_2)  # s0*s1
transpose_1 = aten.transpose(transpose, 1, 2)  # [s0, s1, 128]
view_5 = aten.view(transpose_1, [mul_9, 128])  # [s0*s1, 128]
causal_conv1d = dspark.causal_conv1d(view_5, squeeze, None, conv_state_0, query_start_loc, slots, conv_ring_0, 'silu')  # [s0*s1, 128]
view_6 = aten.view(causal_conv1d, [sym_size_int_1, sym_size_int_2, 128])  # [s0, s1, 128]
transpose_2 = aten.transpose(view_6, 1, 2)  # [s0, 128, s1]
transpose_3 = aten.transpose(transpose_2, 1, 2)  # [s0, s1, 128]
split_with_sizes = aten.split_with_sizes(transpose_3, [32, 32, 64], -1)
getitem = getitem(split_with_sizes, 0)  # [s0, s1, 32]
getitem_1 = getitem(split_with_sizes, 1)  # [s0, s1, 32]
getitem_2 = getitem(split_with_sizes, 2)  # [s0, s1, 64]
view_7 = aten.view(getitem, [sym_size_int_1, sym_size_int_2, 2, 16])  # [s0, s1, 2, 16]
view_8 = aten.view(getitem_1, [sym_size_int_1, sym_size_int_2, 2, 16])  # [s0, s1, 2, 16]
view_9 = aten.view(getitem_2, [sym_size_int_1, sym_size_int_2, 4, 16])  # [s0, s1, 4, 16]
sigmoid = aten.sigmoid(_unsafe_view_2)  # [s0, s1, 4]
exp = aten.exp(model_layers_0_linear_attn_A_log)  # [4]
neg = aten.neg(exp)  # [4]
add_2 = aten.add(_unsafe_view_3, model_layers_0_linear_attn_dt_bias)  # [s0, s1, 4]
softplus = aten.softplus(add_2)  # [s0, s1, 4]
mul_10 = aten.mul(neg, softplus)  # [s0, s1, 4]
sym_size = aten.sym_size(input_ids, 0)  # s0
sym_size_1 = aten.sym_size(input_ids, 1)  # s1
mul_11 = mul(sym_size, sym_size_1)  # s0*s1
view_10 = aten.view(view_7, [mul_11, 2, 16])  # [s0*s1, 2, 16]
view_11 = aten.view(view_8, [mul_11, 2, 16])  # [s0*s1, 2, 16]
view_12 = aten.view(view_9, [mul_11, 4, 16])  # [s0*s1, 4, 16]
view_13 = aten.view(mul_10, [mul_11, 4])  # [s0*s1, 4]
view_14 = aten.view(sigmoid, [mul_11, 4])  # [s0*s1, 4]
gated_delta_rule = dspark.gated_delta_rule(view_10, view_11, view_12, view_13, view_14, recurrent_state_0, query_start_loc, slots, gdn_ring_k_0, gdn_ring_v_0, gdn_ring_g_0, gdn_ring_beta_0, 0.25, True)  # [s0*s1, 4, 16]
view_15 = aten.view(gated_delta_rule, [sym_size, sym_size_1, 4, 16])  # [s0, s1, 4, 16]
view_16 = aten.view(view_15, [-1, 16])  # [4*s0*s1, 16]
view_17 = aten.view(view_2, [-1, 16])  # [4*s0*s1, 16]
pow_1 = aten.pow(view_16, 2)  # [4*s0*s1, 16]
mean_1 = aten.mean(pow_1, [-1], True)  # [4*s0*s1, 1]
add_3 = aten.add(mean_1, 1e-06)  # [4*s0*s1, 1]
rsqrt_1 = aten.rsqrt(add_3)  # [4*s0*s1, 1]
mul_12 = aten.mul(view_16, rsqrt_1)  # [4*s0*s1, 16]
mul_13 = aten.mul(model_layers_0_linear_attn_norm_weight, mul_12)  # [4*s0*s1, 16]
silu = aten.silu(view_17)  # [4*s0*s1, 16]
mul_14 = aten.mul(mul_13, silu)  # [4*s0*s1, 16]
view_18 = aten.view(mul_14, [sym_size_int_1, sym_size_int_2, -1])  # [s0, s1, 64]""")

    def test_flatten_tokens(self):
        self.assertExpectedInline(self.texts["flatten_tokens"], """\
inputs: input_ids[s0], positions[s0], block_table[s1, 2], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], slots[s2], conv_state_0[3, 128, 3], recurrent_state_0[3, 4, 16, 16], query_start_loc[s3], seq_lens[s4], slot_mapping[s5], conv_ring_0[16, 128], gdn_ring_k_0[16, 2, 16], gdn_ring_v_0[16, 4, 16], gdn_ring_g_0[16, 4], gdn_ring_beta_0[16, 4]
t = aten.t(model_layers_0_linear_attn_in_proj_qkv_weight)  # [64, 128]
view = aten.view(mul_4, [sym_size_int, 64])  # [s0, 64]
mm = aten.mm(view, t)  # [s0, 128]
_unsafe_view = aten._unsafe_view(mm, [sym_size_int, 128])  # [s0, 128]
permute = aten.permute(_unsafe_view, [1, 0])  # [128, s0]
t_1 = aten.t(model_layers_0_linear_attn_in_proj_z_weight)  # [64, 64]
view_1 = aten.view(mul_4, [sym_size_int, 64])  # [s0, 64]
mm_1 = aten.mm(view_1, t_1)  # [s0, 64]
_unsafe_view_1 = aten._unsafe_view(mm_1, [sym_size_int, 64])  # [s0, 64]
view_2 = aten.view(_unsafe_view_1, [sym_size_int, -1, 16])  # [s0, 4, 16]
t_2 = aten.t(model_layers_0_linear_attn_in_proj_b_weight)  # [64, 4]
view_3 = aten.view(mul_4, [sym_size_int, 64])  # [s0, 64]
mm_2 = aten.mm(view_3, t_2)  # [s0, 4]
_unsafe_view_2 = aten._unsafe_view(mm_2, [sym_size_int, 4])  # [s0, 4]
t_3 = aten.t(model_layers_0_linear_attn_in_proj_a_weight)  # [64, 4]
view_4 = aten.view(mul_4, [sym_size_int, 64])  # [s0, 64]
mm_3 = aten.mm(view_4, t_3)  # [s0, 4]
_unsafe_view_3 = aten._unsafe_view(mm_3, [sym_size_int, 4])  # [s0, 4]
squeeze = aten.squeeze(model_layers_0_linear_attn_conv1d_weight, 1)  # [128, 4]
permute_1 = aten.permute(permute, [1, 0])  # [s0, 128]
view_5 = aten.view(permute_1, [sym_size_int, 128])  # [s0, 128]
causal_conv1d = dspark.causal_conv1d(view_5, squeeze, None, conv_state_0, query_start_loc, slots, conv_ring_0, 'silu')  # [s0, 128]
view_6 = aten.view(causal_conv1d, [sym_size_int, 128])  # [s0, 128]
permute_2 = aten.permute(view_6, [1, 0])  # [128, s0]
permute_3 = aten.permute(permute_2, [1, 0])  # [s0, 128]
split_with_sizes = aten.split_with_sizes(permute_3, [32, 32, 64], 1)
getitem = getitem(split_with_sizes, 0)  # [s0, 32]
getitem_1 = getitem(split_with_sizes, 1)  # [s0, 32]
getitem_2 = getitem(split_with_sizes, 2)  # [s0, 64]
view_7 = aten.view(getitem, [sym_size_int, 2, 16])  # [s0, 2, 16]
view_8 = aten.view(getitem_1, [sym_size_int, 2, 16])  # [s0, 2, 16]
view_9 = aten.view(getitem_2, [sym_size_int, 4, 16])  # [s0, 4, 16]
sigmoid = aten.sigmoid(_unsafe_view_2)  # [s0, 4]
exp = aten.exp(model_layers_0_linear_attn_A_log)  # [4]
neg = aten.neg(exp)  # [4]
add_2 = aten.add(_unsafe_view_3, model_layers_0_linear_attn_dt_bias)  # [s0, 4]
softplus = aten.softplus(add_2)  # [s0, 4]
mul_5 = aten.mul(neg, softplus)  # [s0, 4]
view_10 = aten.view(view_7, [sym_size_int, 2, 16])  # [s0, 2, 16]
view_11 = aten.view(view_8, [sym_size_int, 2, 16])  # [s0, 2, 16]
view_12 = aten.view(view_9, [sym_size_int, 4, 16])  # [s0, 4, 16]
view_13 = aten.view(mul_5, [sym_size_int, 4])  # [s0, 4]
view_14 = aten.view(sigmoid, [sym_size_int, 4])  # [s0, 4]
gated_delta_rule = dspark.gated_delta_rule(view_10, view_11, view_12, view_13, view_14, recurrent_state_0, query_start_loc, slots, gdn_ring_k_0, gdn_ring_v_0, gdn_ring_g_0, gdn_ring_beta_0, 0.25, True)  # [s0, 4, 16]
view_15 = aten.view(gated_delta_rule, [sym_size_int, 4, 16])  # [s0, 4, 16]
mul_6 = mul(sym_size_int, 4)  # 4*s0
view_16 = aten.view(view_15, [mul_6, 16])  # [4*s0, 16]
mul_7 = mul(sym_size_int, 4)  # 4*s0
view_17 = aten.view(view_2, [mul_7, 16])  # [4*s0, 16]
pow_1 = aten.pow(view_16, 2)  # [4*s0, 16]
mean_1 = aten.mean(pow_1, [1], True)  # [4*s0, 1]
add_3 = aten.add(mean_1, 1e-06)  # [4*s0, 1]
rsqrt_1 = aten.rsqrt(add_3)  # [4*s0, 1]
mul_8 = aten.mul(view_16, rsqrt_1)  # [4*s0, 16]
mul_9 = aten.mul(model_layers_0_linear_attn_norm_weight, mul_8)  # [4*s0, 16]
silu = aten.silu(view_17)  # [4*s0, 16]
mul_10 = aten.mul(mul_9, silu)  # [4*s0, 16]
view_18 = aten.view(mul_10, [sym_size_int, -1])  # [s0, 64]""")
