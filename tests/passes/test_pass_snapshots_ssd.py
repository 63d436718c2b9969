"""Snapshots of a Mamba-2 mixer before and after ``ragged_ssd``.

Only the mixer's section of the graph is shown (from its input projection to its output
projection). Regenerate with EXPECTTEST_ACCEPT=1, on the versions pinned in
test_pass_snapshots.py.
"""

import pytest
import torch
import transformers
from expecttest import TestCase

from test_pass_snapshots import HF_SNAPSHOT_VERSION, TORCH_SNAPSHOT_VERSION, stages

pytestmark = [
    pytest.mark.skipif(not torch.__version__.startswith(TORCH_SNAPSHOT_VERSION),
                       reason=f"snapshots were taken on torch {TORCH_SNAPSHOT_VERSION}"),
    pytest.mark.skipif(transformers.__version__ != HF_SNAPSHOT_VERSION,
                       reason=f"snapshots were taken on transformers {HF_SNAPSHOT_VERSION}"),
]


def mixer_section(text: str) -> str:
    """The inputs line plus the mixer's lines (in_proj up to out_proj)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if "mixer_in_proj_weight)" in ln)
    end = next(i for i, ln in enumerate(lines) if "mixer_out_proj_weight)" in ln)
    return "\n".join([lines[0], *lines[start:end]])


def tiny_mamba2():
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=13, hidden_size=8, num_heads=2, head_dim=8,
                                    state_size=4, n_groups=1, expand=2, conv_kernel=4,
                                    num_hidden_layers=1, chunk_size=4)
    return transformers.Mamba2ForCausalLM(cfg).eval()


class Mamba2MixerSnapshots(TestCase):
    @classmethod
    def setUpClass(cls):
        cls.texts = {k: mixer_section(v) for k, v in stages(tiny_mamba2()).items()}

    def test_before_ragged_ssd(self):
        self.assertExpectedInline(self.texts["ragged_linear_attention"], """\
inputs: input_ids[s0, s1], positions[s2, s3], block_table[s4, 2], slots[s5], conv_state_0[3, 24, 3], recurrent_state_0[3, 2, 4, 8], query_start_loc[s0 + 1], conv_ring_0[16, 24]
t = aten.t(backbone_layers_0_mixer_in_proj_weight)  # [8, 42]
sym_size_int = aten.sym_size(input_ids, 0)  # s0
sym_size_int_1 = aten.sym_size(input_ids, 1)  # s1
mul_2 = mul(sym_size_int, sym_size_int_1)  # s0*s1
view = aten.view(mul_1, [mul_2, 8])  # [s0*s1, 8]
mm = aten.mm(view, t)  # [s0*s1, 42]
_unsafe_view = aten._unsafe_view(mm, [sym_size_int, sym_size_int_1, 42])  # [s0, s1, 42]
exp = aten.exp(backbone_layers_0_mixer_A_log)  # [2]
neg = aten.neg(exp)  # [2]
split_with_sizes = aten.split_with_sizes(_unsafe_view, [16, 24, 2], -1)
getitem = getitem(split_with_sizes, 0)  # [s0, s1, 16]
getitem_1 = getitem(split_with_sizes, 1)  # [s0, s1, 24]
getitem_2 = getitem(split_with_sizes, 2)  # [s0, s1, 2]
transpose = aten.transpose(getitem_1, 1, 2)  # [s0, 24, s1]
squeeze = aten.squeeze(backbone_layers_0_mixer_conv1d_weight, 1)  # [24, 4]
mul_3 = mul(sym_size_int, sym_size_int_1)  # s0*s1
transpose_1 = aten.transpose(transpose, 1, 2)  # [s0, s1, 24]
view_1 = aten.view(transpose_1, [mul_3, 24])  # [s0*s1, 24]
causal_conv1d = dspark.causal_conv1d(view_1, squeeze, backbone_layers_0_mixer_conv1d_bias, conv_state_0, query_start_loc, slots, conv_ring_0, 'silu')  # [s0*s1, 24]
view_2 = aten.view(causal_conv1d, [sym_size_int, sym_size_int_1, 24])  # [s0, s1, 24]
transpose_2 = aten.transpose(view_2, 1, 2)  # [s0, 24, s1]
transpose_3 = aten.transpose(transpose_2, 1, 2)  # [s0, s1, 24]
split_with_sizes_1 = aten.split_with_sizes(transpose_3, [16, 4, 4], -1)
getitem_3 = getitem(split_with_sizes_1, 0)  # [s0, s1, 16]
getitem_4 = getitem(split_with_sizes_1, 1)  # [s0, s1, 4]
getitem_5 = getitem(split_with_sizes_1, 2)  # [s0, s1, 4]
view_3 = aten.view(getitem_3, [sym_size_int, sym_size_int_1, 2, 8])  # [s0, s1, 2, 8]
view_4 = aten.view(getitem_4, [sym_size_int, sym_size_int_1, 1, 4])  # [s0, s1, 1, 4]
view_5 = aten.view(getitem_5, [sym_size_int, sym_size_int_1, 1, 4])  # [s0, s1, 1, 4]
dense_ssd = dspark.dense_ssd(view_3, getitem_2, neg, view_4, view_5, backbone_layers_0_mixer_D, backbone_layers_0_mixer_dt_bias, recurrent_state_0, slots, True, 0, inf)  # [s0, s1, 2, 8]
view_6 = aten.view(dense_ssd, [sym_size_int, sym_size_int_1, -1])  # [s0, s1, 16]
silu = aten.silu(getitem)  # [s0, s1, 16]
mul_4 = aten.mul(view_6, silu)  # [s0, s1, 16]
sym_size_int_2 = aten.sym_size(_unsafe_view, 1)  # s1
view_7 = aten.view(mul_4, [sym_size_int, sym_size_int_2, 1, 16])  # [s0, s1, 1, 16]
pow_1 = aten.pow(view_7, 2)  # [s0, s1, 1, 16]
mean_1 = aten.mean(pow_1, [-1], True)  # [s0, s1, 1, 1]
add_1 = aten.add(mean_1, 1e-05)  # [s0, s1, 1, 1]
rsqrt_1 = aten.rsqrt(add_1)  # [s0, s1, 1, 1]
mul_5 = aten.mul(view_7, rsqrt_1)  # [s0, s1, 1, 16]
view_8 = aten.view(mul_5, [sym_size_int, sym_size_int_2, 16])  # [s0, s1, 16]
mul_6 = aten.mul(backbone_layers_0_mixer_norm_weight, view_8)  # [s0, s1, 16]""")

    def test_ragged_ssd(self):
        self.assertExpectedInline(self.texts["ragged_ssd"], """\
inputs: input_ids[s0, s1], positions[s2, s3], block_table[s4, 2], slots[s5], conv_state_0[3, 24, 3], recurrent_state_0[3, 2, 4, 8], query_start_loc[s0 + 1], conv_ring_0[16, 24], ssd_ring_x_0[16, 2, 8], ssd_ring_b_0[16, 1, 4], ssd_ring_da_0[16, 2]
t = aten.t(backbone_layers_0_mixer_in_proj_weight)  # [8, 42]
sym_size_int = aten.sym_size(input_ids, 0)  # s0
sym_size_int_1 = aten.sym_size(input_ids, 1)  # s1
mul_2 = mul(sym_size_int, sym_size_int_1)  # s0*s1
view = aten.view(mul_1, [mul_2, 8])  # [s0*s1, 8]
mm = aten.mm(view, t)  # [s0*s1, 42]
_unsafe_view = aten._unsafe_view(mm, [sym_size_int, sym_size_int_1, 42])  # [s0, s1, 42]
exp = aten.exp(backbone_layers_0_mixer_A_log)  # [2]
neg = aten.neg(exp)  # [2]
split_with_sizes = aten.split_with_sizes(_unsafe_view, [16, 24, 2], -1)
getitem = getitem(split_with_sizes, 0)  # [s0, s1, 16]
getitem_1 = getitem(split_with_sizes, 1)  # [s0, s1, 24]
getitem_2 = getitem(split_with_sizes, 2)  # [s0, s1, 2]
transpose = aten.transpose(getitem_1, 1, 2)  # [s0, 24, s1]
squeeze = aten.squeeze(backbone_layers_0_mixer_conv1d_weight, 1)  # [24, 4]
mul_3 = mul(sym_size_int, sym_size_int_1)  # s0*s1
transpose_1 = aten.transpose(transpose, 1, 2)  # [s0, s1, 24]
view_1 = aten.view(transpose_1, [mul_3, 24])  # [s0*s1, 24]
causal_conv1d = dspark.causal_conv1d(view_1, squeeze, backbone_layers_0_mixer_conv1d_bias, conv_state_0, query_start_loc, slots, conv_ring_0, 'silu')  # [s0*s1, 24]
view_2 = aten.view(causal_conv1d, [sym_size_int, sym_size_int_1, 24])  # [s0, s1, 24]
transpose_2 = aten.transpose(view_2, 1, 2)  # [s0, 24, s1]
transpose_3 = aten.transpose(transpose_2, 1, 2)  # [s0, s1, 24]
split_with_sizes_1 = aten.split_with_sizes(transpose_3, [16, 4, 4], -1)
getitem_3 = getitem(split_with_sizes_1, 0)  # [s0, s1, 16]
getitem_4 = getitem(split_with_sizes_1, 1)  # [s0, s1, 4]
getitem_5 = getitem(split_with_sizes_1, 2)  # [s0, s1, 4]
view_3 = aten.view(getitem_3, [sym_size_int, sym_size_int_1, 2, 8])  # [s0, s1, 2, 8]
view_4 = aten.view(getitem_4, [sym_size_int, sym_size_int_1, 1, 4])  # [s0, s1, 1, 4]
view_5 = aten.view(getitem_5, [sym_size_int, sym_size_int_1, 1, 4])  # [s0, s1, 1, 4]
sym_size = aten.sym_size(input_ids, 0)  # s0
sym_size_1 = aten.sym_size(input_ids, 1)  # s1
mul_4 = mul(sym_size, sym_size_1)  # s0*s1
view_6 = aten.view(view_3, [mul_4, 2, 8])  # [s0*s1, 2, 8]
view_7 = aten.view(getitem_2, [mul_4, 2])  # [s0*s1, 2]
view_8 = aten.view(view_4, [mul_4, 1, 4])  # [s0*s1, 1, 4]
view_9 = aten.view(view_5, [mul_4, 1, 4])  # [s0*s1, 1, 4]
ssd = dspark.ssd(view_6, view_7, neg, view_8, view_9, backbone_layers_0_mixer_D, backbone_layers_0_mixer_dt_bias, recurrent_state_0, query_start_loc, slots, ssd_ring_x_0, ssd_ring_b_0, ssd_ring_da_0, True, 0, inf)  # [s0*s1, 2, 8]
view_10 = aten.view(ssd, [sym_size, sym_size_1, 2, 8])  # [s0, s1, 2, 8]
view_11 = aten.view(view_10, [sym_size_int, sym_size_int_1, -1])  # [s0, s1, 16]
silu = aten.silu(getitem)  # [s0, s1, 16]
mul_5 = aten.mul(view_11, silu)  # [s0, s1, 16]
sym_size_int_2 = aten.sym_size(_unsafe_view, 1)  # s1
view_12 = aten.view(mul_5, [sym_size_int, sym_size_int_2, 1, 16])  # [s0, s1, 1, 16]
pow_1 = aten.pow(view_12, 2)  # [s0, s1, 1, 16]
mean_1 = aten.mean(pow_1, [-1], True)  # [s0, s1, 1, 1]
add_1 = aten.add(mean_1, 1e-05)  # [s0, s1, 1, 1]
rsqrt_1 = aten.rsqrt(add_1)  # [s0, s1, 1, 1]
mul_6 = aten.mul(view_12, rsqrt_1)  # [s0, s1, 1, 16]
view_13 = aten.view(mul_6, [sym_size_int, sym_size_int_2, 16])  # [s0, s1, 16]
mul_7 = aten.mul(backbone_layers_0_mixer_norm_weight, view_13)  # [s0, s1, 16]""")
