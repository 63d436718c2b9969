"""Snapshots of flat_mrope on tiny Qwen2-VL (chunked sections) and Qwen3-VL (interleaved
sections): the rotary prologue of the graph, from the inputs to the first decoder norm, after
capture, after flat_mrope and after flatten_tokens (regenerate: EXPECTTEST_ACCEPT=1)."""

import pytest
import torch
from expecttest import TestCase

from helpers import tiny_vl
from test_pass_snapshots import TORCH_SNAPSHOT_VERSION, stages

pytestmark = pytest.mark.skipif(not torch.__version__.startswith(TORCH_SNAPSHOT_VERSION),
                                reason=f"snapshots were taken on torch {TORCH_SNAPSHOT_VERSION}")


def prologue(text: str) -> str:
    """The graph text up to the first decoder layer's RMSNorm (``pow``)."""
    lines = text.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("pow = "))
    return "\n".join(lines[:end])


def _model(family):
    model = tiny_vl(family)
    model.model.language_model.layers = model.model.language_model.layers[:1]
    return model


class Qwen2VLSnapshots(TestCase):
    @classmethod
    def setUpClass(cls):
        cls.texts = stages(_model("qwen2_vl"))

    def test_captured(self):
        self.assertExpectedInline(prologue(self.texts["captured"]), """\
inputs: input_ids[s0, s1], positions[3, s0, s1], block_table[s2, 2], context_lens[s3], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], vision_embeds[s0, s1, 64]
embedding = aten.embedding(model_language_model_embed_tokens_weight, input_ids)  # [s0, s1, 64]
eq = aten.eq(input_ids, 61)  # [s0, s1]
eq_1 = aten.eq(input_ids, 62)  # [s0, s1]
bitwise_or = aten.bitwise_or(eq, eq_1)  # [s0, s1]
ne = aten.ne(vision_embeds, 0)  # [s0, s1, 64]
any = aten.any(ne, -1)  # [s0, s1]
bitwise_and = aten.bitwise_and(bitwise_or, any)  # [s0, s1]
unsqueeze = aten.unsqueeze(bitwise_and, -1)  # [s0, s1, 1]
where = aten.where(unsqueeze, vision_embeds, embedding)  # [s0, s1, 64]
expand = aten.expand(positions, [3, -1, -1])  # [3, s0, s1]
unsqueeze_1 = aten.unsqueeze(expand, 3)  # [3, s0, s1, 1]
_to_copy = aten._to_copy(unsqueeze_1, dtype=float32)  # [3, s0, s1, 1]
mul = aten.mul(_to_copy, model_language_model_rotary_emb_inv_freq)  # [3, s0, s1, 8]
cos = aten.cos(mul)  # [3, s0, s1, 8]
mul_1 = aten.mul(cos, 1)  # [3, s0, s1, 8]
sin = aten.sin(mul)  # [3, s0, s1, 8]
mul_2 = aten.mul(sin, 1)  # [3, s0, s1, 8]
split_with_sizes = aten.split_with_sizes(mul_2, [2, 3, 3], -1)
getitem = getitem(split_with_sizes, 0)  # [3, s0, s1, 2]
getitem_1 = getitem(split_with_sizes, 1)  # [3, s0, s1, 3]
getitem_2 = getitem(split_with_sizes, 2)  # [3, s0, s1, 3]
select = aten.select(getitem, 0, 0)  # [s0, s1, 2]
select_1 = aten.select(getitem_1, 0, 1)  # [s0, s1, 3]
select_2 = aten.select(getitem_2, 0, 2)  # [s0, s1, 3]
cat = aten.cat([select, select_1, select_2], -1)  # [s0, s1, 8]
cat_1 = aten.cat([cat, cat], -1)  # [s0, s1, 16]
split_with_sizes_1 = aten.split_with_sizes(mul_1, [2, 3, 3], -1)
getitem_3 = getitem(split_with_sizes_1, 0)  # [3, s0, s1, 2]
getitem_4 = getitem(split_with_sizes_1, 1)  # [3, s0, s1, 3]
getitem_5 = getitem(split_with_sizes_1, 2)  # [3, s0, s1, 3]
select_3 = aten.select(getitem_3, 0, 0)  # [s0, s1, 2]
select_4 = aten.select(getitem_4, 0, 1)  # [s0, s1, 3]
select_5 = aten.select(getitem_5, 0, 2)  # [s0, s1, 3]
cat_2 = aten.cat([select_3, select_4, select_5], -1)  # [s0, s1, 8]
cat_3 = aten.cat([cat_2, cat_2], -1)  # [s0, s1, 16]""")

    def test_flat_mrope(self):
        self.assertExpectedInline(prologue(self.texts["flat_mrope"]), """\
inputs: input_ids[s0, s1], mrope_positions[3, s0*s1], block_table[s2, 2], context_lens[s3], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], vision_embeds[s0, s1, 64]
sym_size_int = aten.sym_size(input_ids, 0)  # s0
sym_size_int_1 = aten.sym_size(input_ids, 1)  # s1
view = aten.view(mrope_positions, [3, sym_size_int, sym_size_int_1])  # [3, s0, s1]
embedding = aten.embedding(model_language_model_embed_tokens_weight, input_ids)  # [s0, s1, 64]
eq = aten.eq(input_ids, 61)  # [s0, s1]
eq_1 = aten.eq(input_ids, 62)  # [s0, s1]
bitwise_or = aten.bitwise_or(eq, eq_1)  # [s0, s1]
ne = aten.ne(vision_embeds, 0)  # [s0, s1, 64]
any = aten.any(ne, -1)  # [s0, s1]
bitwise_and = aten.bitwise_and(bitwise_or, any)  # [s0, s1]
unsqueeze = aten.unsqueeze(bitwise_and, -1)  # [s0, s1, 1]
where = aten.where(unsqueeze, vision_embeds, embedding)  # [s0, s1, 64]
expand = aten.expand(view, [3, -1, -1])  # [3, s0, s1]
unsqueeze_1 = aten.unsqueeze(expand, 3)  # [3, s0, s1, 1]
_to_copy = aten._to_copy(unsqueeze_1, dtype=float32)  # [3, s0, s1, 1]
mul = aten.mul(_to_copy, model_language_model_rotary_emb_inv_freq)  # [3, s0, s1, 8]
cos = aten.cos(mul)  # [3, s0, s1, 8]
mul_1 = aten.mul(cos, 1)  # [3, s0, s1, 8]
sin = aten.sin(mul)  # [3, s0, s1, 8]
mul_2 = aten.mul(sin, 1)  # [3, s0, s1, 8]
split_with_sizes = aten.split_with_sizes(mul_2, [2, 3, 3], -1)
getitem = getitem(split_with_sizes, 0)  # [3, s0, s1, 2]
getitem_1 = getitem(split_with_sizes, 1)  # [3, s0, s1, 3]
getitem_2 = getitem(split_with_sizes, 2)  # [3, s0, s1, 3]
select = aten.select(getitem, 0, 0)  # [s0, s1, 2]
select_1 = aten.select(getitem_1, 0, 1)  # [s0, s1, 3]
select_2 = aten.select(getitem_2, 0, 2)  # [s0, s1, 3]
cat = aten.cat([select, select_1, select_2], -1)  # [s0, s1, 8]
cat_1 = aten.cat([cat, cat], -1)  # [s0, s1, 16]
split_with_sizes_1 = aten.split_with_sizes(mul_1, [2, 3, 3], -1)
getitem_3 = getitem(split_with_sizes_1, 0)  # [3, s0, s1, 2]
getitem_4 = getitem(split_with_sizes_1, 1)  # [3, s0, s1, 3]
getitem_5 = getitem(split_with_sizes_1, 2)  # [3, s0, s1, 3]
select_3 = aten.select(getitem_3, 0, 0)  # [s0, s1, 2]
select_4 = aten.select(getitem_4, 0, 1)  # [s0, s1, 3]
select_5 = aten.select(getitem_5, 0, 2)  # [s0, s1, 3]
cat_2 = aten.cat([select_3, select_4, select_5], -1)  # [s0, s1, 8]
cat_3 = aten.cat([cat_2, cat_2], -1)  # [s0, s1, 16]""")

    def test_flatten_tokens(self):
        self.assertExpectedInline(prologue(self.texts["flatten_tokens"]), """\
inputs: input_ids[s0], mrope_positions[3, s0], block_table[s1, 2], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], vision_embeds[s0, 64], query_start_loc[s2], seq_lens[s3], slot_mapping[s4]
sym_size_int = aten.sym_size(input_ids, 0)  # s0
view = aten.view(mrope_positions, [3, sym_size_int])  # [3, s0]
embedding = aten.embedding(model_language_model_embed_tokens_weight, input_ids)  # [s0, 64]
eq = aten.eq(input_ids, 61)  # [s0]
eq_1 = aten.eq(input_ids, 62)  # [s0]
bitwise_or = aten.bitwise_or(eq, eq_1)  # [s0]
ne = aten.ne(vision_embeds, 0)  # [s0, 64]
any = aten.any(ne, 1)  # [s0]
bitwise_and = aten.bitwise_and(bitwise_or, any)  # [s0]
unsqueeze = aten.unsqueeze(bitwise_and, 1)  # [s0, 1]
where = aten.where(unsqueeze, vision_embeds, embedding)  # [s0, 64]
expand = aten.expand(view, [3, sym_size_int])  # [3, s0]
unsqueeze_1 = aten.unsqueeze(expand, 2)  # [3, s0, 1]
_to_copy = aten._to_copy(unsqueeze_1, dtype=float32)  # [3, s0, 1]
mul = aten.mul(_to_copy, model_language_model_rotary_emb_inv_freq)  # [3, s0, 8]
cos = aten.cos(mul)  # [3, s0, 8]
mul_1 = aten.mul(cos, 1)  # [3, s0, 8]
sin = aten.sin(mul)  # [3, s0, 8]
mul_2 = aten.mul(sin, 1)  # [3, s0, 8]
split_with_sizes = aten.split_with_sizes(mul_2, [2, 3, 3], 2)
getitem = getitem(split_with_sizes, 0)  # [3, s0, 2]
getitem_1 = getitem(split_with_sizes, 1)  # [3, s0, 3]
getitem_2 = getitem(split_with_sizes, 2)  # [3, s0, 3]
select = aten.select(getitem, 0, 0)  # [s0, 2]
select_1 = aten.select(getitem_1, 0, 1)  # [s0, 3]
select_2 = aten.select(getitem_2, 0, 2)  # [s0, 3]
cat = aten.cat([select, select_1, select_2], 1)  # [s0, 8]
cat_1 = aten.cat([cat, cat], 1)  # [s0, 16]
split_with_sizes_1 = aten.split_with_sizes(mul_1, [2, 3, 3], 2)
getitem_3 = getitem(split_with_sizes_1, 0)  # [3, s0, 2]
getitem_4 = getitem(split_with_sizes_1, 1)  # [3, s0, 3]
getitem_5 = getitem(split_with_sizes_1, 2)  # [3, s0, 3]
select_3 = aten.select(getitem_3, 0, 0)  # [s0, 2]
select_4 = aten.select(getitem_4, 0, 1)  # [s0, 3]
select_5 = aten.select(getitem_5, 0, 2)  # [s0, 3]
cat_2 = aten.cat([select_3, select_4, select_5], 1)  # [s0, 8]
cat_3 = aten.cat([cat_2, cat_2], 1)  # [s0, 16]""")


class Qwen3VLSnapshots(TestCase):
    @classmethod
    def setUpClass(cls):
        cls.texts = stages(_model("qwen3_vl"))

    def test_flat_mrope(self):
        self.assertExpectedInline(prologue(self.texts["flat_mrope"]), """\
inputs: input_ids[s0, s1], mrope_positions[3, s0*s1], block_table[s2, 2], context_lens[s3], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], vision_embeds[s0, s1, 64]
sym_size_int = aten.sym_size(input_ids, 0)  # s0
sym_size_int_1 = aten.sym_size(input_ids, 1)  # s1
view = aten.view(mrope_positions, [3, sym_size_int, sym_size_int_1])  # [3, s0, s1]
embedding = aten.embedding(model_language_model_embed_tokens_weight, input_ids)  # [s0, s1, 64]
eq = aten.eq(input_ids, 61)  # [s0, s1]
eq_1 = aten.eq(input_ids, 62)  # [s0, s1]
bitwise_or = aten.bitwise_or(eq, eq_1)  # [s0, s1]
ne = aten.ne(vision_embeds, 0)  # [s0, s1, 64]
any = aten.any(ne, -1)  # [s0, s1]
bitwise_and = aten.bitwise_and(bitwise_or, any)  # [s0, s1]
unsqueeze = aten.unsqueeze(bitwise_and, -1)  # [s0, s1, 1]
where = aten.where(unsqueeze, vision_embeds, embedding)  # [s0, s1, 64]
expand = aten.expand(view, [3, -1, -1])  # [3, s0, s1]
unsqueeze_1 = aten.unsqueeze(expand, 3)  # [3, s0, s1, 1]
_to_copy = aten._to_copy(unsqueeze_1, dtype=float32)  # [3, s0, s1, 1]
mul = aten.mul(_to_copy, model_language_model_rotary_emb_inv_freq)  # [3, s0, s1, 8]
cos = aten.cos(mul)  # [3, s0, s1, 8]
mul_1 = aten.mul(cos, 1)  # [3, s0, s1, 8]
sin = aten.sin(mul)  # [3, s0, s1, 8]
mul_2 = aten.mul(sin, 1)  # [3, s0, s1, 8]
select = aten.select(mul_2, 0, 0)  # [s0, s1, 8]
select_1 = aten.select(mul_2, 0, 1)  # [s0, s1, 8]
slice = aten.slice(select_1, 2, 1, 9, 3)  # [s0, s1, 3]
slice_1 = aten.slice(select, 2, 1, 9, 3)  # [s0, s1, 3]
copy_ = aten.copy_(slice_1, slice)  # [s0, s1, 3]
select_2 = aten.select(mul_2, 0, 2)  # [s0, s1, 8]
slice_2 = aten.slice(select_2, 2, 2, 9, 3)  # [s0, s1, 2]
slice_3 = aten.slice(select, 2, 2, 9, 3)  # [s0, s1, 2]
copy__1 = aten.copy_(slice_3, slice_2)  # [s0, s1, 2]
cat = aten.cat([select, select], -1)  # [s0, s1, 16]
select_3 = aten.select(mul_1, 0, 0)  # [s0, s1, 8]
select_4 = aten.select(mul_1, 0, 1)  # [s0, s1, 8]
slice_4 = aten.slice(select_4, 2, 1, 9, 3)  # [s0, s1, 3]
slice_5 = aten.slice(select_3, 2, 1, 9, 3)  # [s0, s1, 3]
copy__2 = aten.copy_(slice_5, slice_4)  # [s0, s1, 3]
select_5 = aten.select(mul_1, 0, 2)  # [s0, s1, 8]
slice_6 = aten.slice(select_5, 2, 2, 9, 3)  # [s0, s1, 2]
slice_7 = aten.slice(select_3, 2, 2, 9, 3)  # [s0, s1, 2]
copy__3 = aten.copy_(slice_7, slice_6)  # [s0, s1, 2]
cat_1 = aten.cat([select_3, select_3], -1)  # [s0, s1, 16]""")

    def test_flatten_tokens(self):
        self.assertExpectedInline(prologue(self.texts["flatten_tokens"]), """\
inputs: input_ids[s0], mrope_positions[3, s0], block_table[s1, 2], k_cache_0[6, 4, 2, 16], v_cache_0[6, 4, 2, 16], vision_embeds[s0, 64], query_start_loc[s2], seq_lens[s3], slot_mapping[s4]
sym_size_int = aten.sym_size(input_ids, 0)  # s0
view = aten.view(mrope_positions, [3, sym_size_int])  # [3, s0]
embedding = aten.embedding(model_language_model_embed_tokens_weight, input_ids)  # [s0, 64]
eq = aten.eq(input_ids, 61)  # [s0]
eq_1 = aten.eq(input_ids, 62)  # [s0]
bitwise_or = aten.bitwise_or(eq, eq_1)  # [s0]
ne = aten.ne(vision_embeds, 0)  # [s0, 64]
any = aten.any(ne, 1)  # [s0]
bitwise_and = aten.bitwise_and(bitwise_or, any)  # [s0]
unsqueeze = aten.unsqueeze(bitwise_and, 1)  # [s0, 1]
where = aten.where(unsqueeze, vision_embeds, embedding)  # [s0, 64]
expand = aten.expand(view, [3, sym_size_int])  # [3, s0]
unsqueeze_1 = aten.unsqueeze(expand, 2)  # [3, s0, 1]
_to_copy = aten._to_copy(unsqueeze_1, dtype=float32)  # [3, s0, 1]
mul = aten.mul(_to_copy, model_language_model_rotary_emb_inv_freq)  # [3, s0, 8]
cos = aten.cos(mul)  # [3, s0, 8]
mul_1 = aten.mul(cos, 1)  # [3, s0, 8]
sin = aten.sin(mul)  # [3, s0, 8]
mul_2 = aten.mul(sin, 1)  # [3, s0, 8]
select = aten.select(mul_2, 0, 0)  # [s0, 8]
select_1 = aten.select(mul_2, 0, 1)  # [s0, 8]
slice = aten.slice(select_1, 1, 1, 9, 3)  # [s0, 3]
slice_1 = aten.slice(select, 1, 1, 9, 3)  # [s0, 3]
copy_ = aten.copy_(slice_1, slice)  # [s0, 3]
select_2 = aten.select(mul_2, 0, 2)  # [s0, 8]
slice_2 = aten.slice(select_2, 1, 2, 9, 3)  # [s0, 2]
slice_3 = aten.slice(select, 1, 2, 9, 3)  # [s0, 2]
copy__1 = aten.copy_(slice_3, slice_2)  # [s0, 2]
cat = aten.cat([select, select], 1)  # [s0, 16]
select_3 = aten.select(mul_1, 0, 0)  # [s0, 8]
select_4 = aten.select(mul_1, 0, 1)  # [s0, 8]
slice_4 = aten.slice(select_4, 1, 1, 9, 3)  # [s0, 3]
slice_5 = aten.slice(select_3, 1, 1, 9, 3)  # [s0, 3]
copy__2 = aten.copy_(slice_5, slice_4)  # [s0, 3]
select_5 = aten.select(mul_1, 0, 2)  # [s0, 8]
slice_6 = aten.slice(select_5, 1, 2, 9, 3)  # [s0, 2]
slice_7 = aten.slice(select_3, 1, 2, 9, 3)  # [s0, 2]
copy__3 = aten.copy_(slice_7, slice_6)  # [s0, 2]
cat_1 = aten.cat([select_3, select_3], 1)  # [s0, 16]""")
