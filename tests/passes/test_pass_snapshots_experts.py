"""Snapshots of a Mixtral MoE block before and after ``ragged_experts`` and ``flatten_tokens``.

Only the block's section of the graph is shown (from its router to the experts' result). The
capture emits the experts as ``dspark::experts_route / experts_up / experts_down`` (SwiGLU fused
into ``experts_up``) over ``[bs*T]`` rows; ``ragged_experts`` gives the routing the layout's
``query_start_loc``; ``flatten_tokens`` leaves the ops as they are (flat-native). Regenerate
with EXPECTTEST_ACCEPT=1, on the versions pinned in test_pass_snapshots.py.
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


def moe_section(text: str) -> str:
    """The inputs line plus the block's lines (router matmul up to the experts' result)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if "mlp_gate_weight)" in ln)
    end = next(i for i, ln in enumerate(lines) if "experts_down" in ln)
    return "\n".join([lines[0], *lines[start:end + 2]])


def tiny_mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=13, hidden_size=8, intermediate_size=4,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=4, num_local_experts=4,
                                     num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg).eval()


class MixtralExpertsSnapshots(TestCase):
    @classmethod
    def setUpClass(cls):
        cls.texts = {k: moe_section(v) for k, v in stages(tiny_mixtral()).items()}

    def test_before_ragged_experts(self):
        self.assertExpectedInline(self.texts["ragged_ssd"], """\
inputs: input_ids[s0, s1], positions[s0, s1], block_table[s2, 2], k_cache_0[6, 4, 1, 4], v_cache_0[6, 4, 1, 4], query_start_loc[s0 + 1], seq_lens[s0], slot_mapping[s0*s1]
t_4 = aten.t(model_layers_0_mlp_gate_weight)  # [8, 4]
mm_4 = aten.mm(view_13, t_4)  # [s0*s1, 4]
_softmax = aten._softmax(mm_4, -1, False)  # [s0*s1, 4]
topk = aten.topk(_softmax, 2)
getitem = getitem(topk, 0)  # [s0*s1, 2]
getitem_1 = getitem(topk, 1)  # [s0*s1, 2]
sum = aten.sum(getitem, [-1], True)  # [s0*s1, 1]
div_ = aten.div_(getitem, sum)  # [s0*s1, 2]
experts_route = dspark.experts_route(getitem_1, None, 4)
getitem_2 = getitem(experts_route, 0)  # [2*s0*s1]
getitem_3 = getitem(experts_route, 1)  # [4]
experts_up = dspark.experts_up(view_12, getitem_2, getitem_3, model_layers_0_mlp_experts_gate_up_proj, None, False, 'silu_glu')  # [2*s0*s1, 4]
experts_down = dspark.experts_down(experts_up, getitem_2, getitem_3, div_, model_layers_0_mlp_experts_down_proj, None, False)  # [s0*s1, 8]
view_14 = aten.view(experts_down, [sym_size_int, sym_size_int_1, 8])  # [s0, s1, 8]""")

    def test_ragged_experts(self):
        self.assertExpectedInline(self.texts["ragged_experts"], """\
inputs: input_ids[s0, s1], positions[s0, s1], block_table[s2, 2], k_cache_0[6, 4, 1, 4], v_cache_0[6, 4, 1, 4], query_start_loc[s0 + 1], seq_lens[s0], slot_mapping[s0*s1]
t_4 = aten.t(model_layers_0_mlp_gate_weight)  # [8, 4]
mm_4 = aten.mm(view_13, t_4)  # [s0*s1, 4]
_softmax = aten._softmax(mm_4, -1, False)  # [s0*s1, 4]
topk = aten.topk(_softmax, 2)
getitem = getitem(topk, 0)  # [s0*s1, 2]
getitem_1 = getitem(topk, 1)  # [s0*s1, 2]
sum = aten.sum(getitem, [-1], True)  # [s0*s1, 1]
div_ = aten.div_(getitem, sum)  # [s0*s1, 2]
experts_route = dspark.experts_route(getitem_1, query_start_loc, 4)
getitem_2 = getitem(experts_route, 0)  # [2*s0*s1]
getitem_3 = getitem(experts_route, 1)  # [4]
experts_up = dspark.experts_up(view_12, getitem_2, getitem_3, model_layers_0_mlp_experts_gate_up_proj, None, False, 'silu_glu')  # [2*s0*s1, 4]
experts_down = dspark.experts_down(experts_up, getitem_2, getitem_3, div_, model_layers_0_mlp_experts_down_proj, None, False)  # [s0*s1, 8]
view_14 = aten.view(experts_down, [sym_size_int, sym_size_int_1, 8])  # [s0, s1, 8]""")

    def test_flatten_tokens(self):
        self.assertExpectedInline(self.texts["flatten_tokens"], """\
inputs: input_ids[s0], positions[s0], block_table[s1, 2], k_cache_0[6, 4, 1, 4], v_cache_0[6, 4, 1, 4], query_start_loc[s2], seq_lens[s3], slot_mapping[s4]
t_4 = aten.t(model_layers_0_mlp_gate_weight)  # [8, 4]
mm_4 = aten.mm(view_13, t_4)  # [s0, 4]
_softmax = aten._softmax(mm_4, 1, False)  # [s0, 4]
topk = aten.topk(_softmax, 2)
getitem = getitem(topk, 0)  # [s0, 2]
getitem_1 = getitem(topk, 1)  # [s0, 2]
sum = aten.sum(getitem, [1], True)  # [s0, 1]
div_ = aten.div_(getitem, sum)  # [s0, 2]
experts_route = dspark.experts_route(getitem_1, query_start_loc, 4)
getitem_2 = getitem(experts_route, 0)  # [2*s0]
getitem_3 = getitem(experts_route, 1)  # [4]
experts_up = dspark.experts_up(view_12, getitem_2, getitem_3, model_layers_0_mlp_experts_gate_up_proj, None, False, 'silu_glu')  # [2*s0, 4]
experts_down = dspark.experts_down(experts_up, getitem_2, getitem_3, div_, model_layers_0_mlp_experts_down_proj, None, False)  # [s0, 8]
view_14 = aten.view(experts_down, [sym_size_int, 8])  # [s0, 8]""")
