"""The zoo's tiny configs: sizes by name rules, special token ids inside the vocabulary, every
layer kind of the default config present, rotary parameters kept consistent, the same configs
in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers as T

from dspark_compile.frontend.own_forward import config_token_ids
from dspark_compile.zoo.tiny import SIZES, _fix_rope, special_token_ids, tiny_config


@pytest.mark.parametrize("model_type, cls", [
    ("gpt2", T.GPT2LMHeadModel),          # bos = eos = 50256, n_embd / n_layer / n_head
    ("llama", T.LlamaForCausalLM),
    ("mixtral", T.MixtralForCausalLM),
    ("gemma3", T.Gemma3ForConditionalGeneration),  # composite: text + vision sub-configs
])
def test_sizes_and_special_token_ids(model_type, cls):
    config = tiny_config(model_type, cls).config
    text = config.get_text_config()
    assert text.hidden_size == SIZES["hidden"] and text.num_attention_heads == SIZES["heads"]
    assert text.vocab_size == SIZES["vocab"]
    assert text.max_position_embeddings >= 256
    ids = config_token_ids(config.to_dict())
    assert ids and all(0 <= i < SIZES["vocab"] for i in ids), ids
    if model_type == "gpt2":
        assert config.bos_token_id == config.eos_token_id  # equal ids stay equal
    if model_type == "mixtral":
        assert (text.num_local_experts, text.num_experts_per_tok) == (4, 2)
        assert text.num_key_value_heads == SIZES["kv_heads"]


def test_special_token_ids_move_to_the_top_and_keep_their_identity():
    d = {"vocab_size": 128, "bos_token_id": 50256, "eos_token_id": [50256, 50257],
         "pad_token_id": 0, "text_config": {"model_type": "x", "image_token_id": 151655}}
    special_token_ids(d, 128)
    assert d["bos_token_id"] == d["eos_token_id"][0] == 127
    assert d["eos_token_id"][1] == 126 and d["text_config"]["image_token_id"] == 125
    assert d["pad_token_id"] == 0


@pytest.mark.parametrize("model_type, cls, field, kinds", [
    ("gemma3_text", T.Gemma3ForCausalLM, "layer_types", {"sliding_attention", "full_attention"}),
    ("gpt_oss", T.GptOssForCausalLM, "layer_types", {"sliding_attention", "full_attention"}),
    ("qwen3_5_text", T.Qwen3_5ForCausalLM, "layer_types",
     {"linear_attention", "full_attention"}),
    ("jamba", T.JambaForCausalLM, "layers_block_type", {"mamba", "attention"}),
])
def test_every_layer_type_of_the_default_is_covered(model_type, cls, field, kinds):
    tiny = tiny_config(model_type, cls)
    assert set(getattr(tiny.config, field)) == kinds
    assert tiny.covered == tiny.kinds and tiny.layers <= 8


def test_jamba_has_dense_and_expert_layers_of_its_period_rules():
    """Jamba's pattern is scalar (attention every 8th layer from 4, experts every 2nd from 1):
    the layer count grows until mamba+dense, mamba+MoE and attention layers are all there."""
    config = tiny_config("jamba", T.JambaForCausalLM).config
    experts = [i % config.expert_layer_period == config.expert_layer_offset
               for i in range(config.num_hidden_layers)]
    assert any(experts) and not all(experts)


def test_first_k_dense_layers_leave_a_moe_layer():
    config = tiny_config("deepseek_v3", T.DeepseekV3ForCausalLM).config
    assert config.first_k_dense_replace < config.num_hidden_layers


def test_sliding_window_variant_has_sliding_and_full_layers():
    config = tiny_config("qwen2", T.Qwen2ForCausalLM,
                         {"use_sliding_window": True, "sliding_window": 8}).config
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}
    assert config.sliding_window == SIZES["window"] < 10  # the zoo's shortest prompt is 10


def test_windows_shrink_below_the_sequences():
    assert tiny_config("mistral", T.MistralForCausalLM).config.sliding_window == SIZES["window"]


def test_mla_ranks_are_small_and_kv_heads_follow_the_query_heads():
    config = tiny_config("deepseek_v3", T.DeepseekV3ForCausalLM).config
    assert (config.q_lora_rank, config.kv_lora_rank) == (SIZES["rank"], SIZES["rank"])
    assert config.qk_rope_head_dim == SIZES["rope_head_dim"]
    assert config.num_key_value_heads == config.num_attention_heads


def test_mla_with_an_indexer_keeps_kv_heads_with_the_query_heads():
    """DeepSeek-V3.2 has both ``num_attention_heads`` and its indexer's ``index_n_heads``: the
    query heads decide (a KV count of 2 against 4 query heads breaks HF's own forward)."""
    config = tiny_config("deepseek_v32", T.DeepseekV32ForCausalLM).config
    assert config.num_key_value_heads == config.num_attention_heads == SIZES["heads"]


_EVERY_CONFIG = """
import json, transformers
from dspark_compile.zoo.check import entries
from dspark_compile.zoo.tiny import tiny_config
out = {}
for e in entries():
    try:
        t = tiny_config(e.model_type, getattr(transformers, e.architecture), dict(e.overrides))
        out[e.name] = sorted((k, repr(v)) for k, v in t.changed.items())
    except Exception as err:
        out[e.name] = type(err).__name__
print(json.dumps(out))
"""


def test_every_zoo_config_is_the_same_under_any_string_hashing():
    """Every zoo entry's tiny config, built in two processes whose string hashes differ
    (``PYTHONHASHSEED`` 0 and 1: they iterate sets of field names in different orders), is
    the same: a zoo row cannot change from one run to the next. (Two processes of ~30 s each,
    one per CI core; four doubled the suite's slowest test.)"""
    procs = [subprocess.Popen([sys.executable, "-c", _EVERY_CONFIG], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONHASHSEED": seed})
             for seed in ("0", "1")]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert len(outs[0]) > 100
    differ = sorted({name for name in outs[0] for out in outs[1:]
                     if outs[0][name] != out.get(name)})
    assert not differ, f"tiny configs that depend on string hashing: {differ}"


def test_rope_parameters_follow_the_head_dim():
    assert _fix_rope({"rope_type": "default", "mrope_section": [16, 24, 24]}, 8) == \
        {"rope_type": "default", "mrope_section": [2, 3, 3]}
    long = _fix_rope({"rope_type": "longrope", "short_factor": [1.0] * 64,
                      "long_factor": [2.0] * 64, "factor": 16.0,
                      "original_max_position_embeddings": 4096}, 8)
    assert len(long["short_factor"]) == len(long["long_factor"]) == 8
    assert long["original_max_position_embeddings"] == SIZES["positions"] // 16
    per_type = _fix_rope({"full_attention": {"rope_type": "default", "mrope_section": [8, 8]},
                          "sliding_attention": {"rope_type": "default"}}, 8)
    assert per_type["full_attention"]["mrope_section"] == [4, 4]


def test_towers_keep_per_layer_overrides_and_adapters_consistent_with_their_new_widths():
    """dots.3 Note's vision and audio towers: per-layer override dicts past a tower's new depth
    are dropped (its config refuses a key naming no layer), each adapter's input follows its
    tower's width and its output the text model's; the composite config then builds."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if "dots3_note" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no dots3_note")
    default = CONFIG_MAPPING["dots3_note"]().to_dict()
    assert any(int(k) >= 2 for k in default["vision_config"]["per_layer_config"])
    config = tiny_config("dots3_note").config
    vision, audio, text = config.vision_config, config.audio_config, config.get_text_config()
    assert vision.num_hidden_layers == 2
    assert all(int(k) < 2 for k in (vision.to_dict().get("per_layer_config") or {}))
    assert vision.adapter_in_dim == vision.hidden_size < default["vision_config"]["hidden_size"]
    assert vision.adapter_out_dim == audio.adapter_out_dim == text.hidden_size
    assert audio.adapter_input_size == audio.hidden_size
