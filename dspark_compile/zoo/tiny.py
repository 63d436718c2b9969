"""A tiny random config for any transformers causal LM, built by rules, not a table per model.

Start from the config class's defaults (``to_dict()``, sub-configs included) and rewrite every
field whose *name* says what it is: widths to 64, heads to 4 (KV heads at most 2), head dims to
16, intermediate sizes to 128, vocabularies to 128 (special token ids moved inside it),
positions to 256, experts to 4 with top-k 2, low-rank (MLA) ranks to 32, sliding windows and
attention chunks to 8 so that the zoo's sequences cross them, "the first k layers are dense /
full" counts to at most 1, dropouts to 0. Rotary parameters follow the new head dim (mRoPE
sections rescaled, per-frequency factor lists resized).

Layers: as few as cover every *kind* of layer the default config has. A layer's kind is the
module classes it holds plus its entries in the config's per-layer fields (``layer_types``,
``mlp_layer_types``, index lists such as ``moe_layers``, ...) plus a few per-layer attributes
(``sliding_window``, ``use_rope``, ...). The kinds are read from the default layer count's model
built with tiny widths on the meta device, then the per-layer fields are cut to one layer of
each kind; a config whose pattern is a scalar rule (a period, an offset) grows its layer count
from 2 until every kind is present (at most :data:`MAX_LAYERS`).

``OVERRIDES`` holds what no name rule can guess; keep it short and say why for each entry.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ..frontend.own_forward import TOKEN_ID_KEY, config_token_ids

__all__ = ["SIZES", "MAX_LAYERS", "OVERRIDES", "TinyConfig", "tiny_config", "special_token_ids",
           "layer_kinds", "decoder_stacks"]

SIZES = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, rope_head_dim=8, intermediate=128,
             vocab=128, positions=256, experts=4, top_k=2, rank=32, window=8, layers=2)
"""The tiny sizes every rule writes."""

MAX_LAYERS = 8
"""The most layers a tiny config gets while covering its default's layer kinds."""

# ---------------------------------------------------------------- field names, by role
_HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model", "dim", "model_dim", "embed_dim",
           "emb_dim", "hidden_dim", "d_embed", "word_embed_proj_dim", "lru_width",
           "attention_hidden_size", "embedding_size", "embedding_dim", "input_embedding_size",
           "output_embedding_size")
"""Widths; the first one a config has is its hidden size, and another that was a multiple of
it stays that multiple (Zamba's attention width is twice the hidden size)."""
_LAYERS = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
           "num_decoder_layers", "encoder_layers", "num_encoder_layers", "num_layers_per_stack"}
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
          "decoder_attention_heads", "encoder_attention_heads", "num_decoder_attention_heads",
          "num_encoder_attention_heads", "swa_num_attention_heads", "index_n_heads",
          "indexer_n_heads", "linear_num_value_heads", "linear_num_heads")
"""Head counts, the main attention's first: the first one a config has is its query heads (a
tuple, so that choice never depends on the interpreter's string hashing: DeepSeek-V3.2 has both
``num_attention_heads`` and its indexer's ``index_n_heads``)."""
_KV_HEADS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
             "num_query_groups", "swa_num_key_value_heads", "indexer_kv_heads",
             "linear_num_key_heads"}
_ROTARY_DIMS = {"rotary_dim", "rope_dim"}
"""Rotary widths inside a head: scaled with the head dim (GPT-J rotates 64 of 256)."""
_SSM_HEADS = ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
_SSM_HEAD_DIMS = ("mamba_d_head", "mamba_head_dim", "mamba_headdim", "head_dim")
_SSM_EXPANDS = ("mamba_expand", "expand")
"""Mamba-2 mixers: heads x head dim must equal expand x hidden size."""
_HEAD_DIMS = {"head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels",
              "swa_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
              "index_head_dim", "indexer_head_dim", "attention_head_size", "v_head_dim",
              "qk_nope_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim"}
_ROPE_HEAD_DIMS = {"qk_rope_head_dim"}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOP_K = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k",
          "top_k_experts", "router_topk"}
_AT_MOST_ONE = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                "topk_group", "first_k_dense_replace", "num_dense_layers", "max_window_layers",
                "moe_layer_start_index"}
"""Counts whose default would leave a 2-layer model without its MoE / sliding layers, or
shared experts and expert groups out of proportion to 4 experts."""
_GROUPS = {"n_group", "num_expert_group"}
_RANKS = {"q_lora_rank", "kv_lora_rank", "o_lora_rank", "laurel_rank", "gated_norm_rank",
          "loop_gate_rank", "adapter_rank"}
_WINDOWS = {"sliding_window", "sliding_window_size", "attention_window_size",
            "attention_chunk_size", "window_size", "local_attention_window_len",
            "local_attention", "local_attn_chunk_length"}
_POSITIONS = {"max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
              "max_target_positions", "max_source_positions", "seq_length", "context_length"}
_INTERMEDIATE = re.compile(r"intermediate|ffn|^d_ff$|^dim_ff$|^dff$|^n_inner$|feed_forward")
_DROPOUT = re.compile(r"dropout|pdrop|drop_path|layerdrop")
_ADAPTER_IN = re.compile(r"^adapter_in(put)?_(dim|size)$")
"""A multimodal tower's adapter input, which must equal the tower's own width."""
_ADAPTER_OUT = re.compile(r"^(adapter_out(put)?_(dim|size)|out_hidden_size|text_hidden_size)$")
"""Its output, which must equal the text model's width."""
_LAYER_INDEX_LIST = re.compile(r"layer|idxs|indexes|indices")
_ROPE_DICTS = {"rope_parameters", "rope_scaling"}

MROPE_SECTIONS: dict[str, list[int]] = {
    **{name: [16, 24, 24] for name in ("qwen2_vl", "qwen2_5_vl", "paddleocr_vl")},
    **{name: [8, 12, 12] for name in ("glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga")},
}
"""mRoPE sections of the types whose text rotary falls back to these full-size values when the
config names none (their default configs do not): written into the text config's rotary
parameters before the shrink, which rescales them to the tiny head like any section."""

OVERRIDES: dict[str, dict[str, Any]] = {
    # LFM2's default puts attention in every layer and LFM2-MoE's leaves layer_types None (its
    # model cannot build); real checkpoints mix short-conv and attention layers: take both.
    "lfm2": {"full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # DeepSeek-V4's compressed layers close a window every 4 (CSA) / 128 (HCA) tokens and its
    # indexer keeps 512 entries: the zoo's ~20-token sequences would never see an HCA entry
    # nor a CSA selection. Windows of 2 and 4 tokens, two entries kept per query.
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 2,
                                       "heavily_compressed_attention": 4},
                    "index_topk": 2},
    # DeepSeek Sparse Attention's indexers keep 2048 keys per query: the zoo's ~20-token
    # sequences would attend to every key. Three kept, so most rows select; GLM-5's second
    # layer reuses the first's picks ("shared"), as HY-V4's third does by default. 16 indexer
    # heads (real ones have 32-64): with 4, a key whose every head's dot is negative scores an
    # exact ReLU zero one time in 16, and such ties at the top-k boundary, which HF's own
    # forwards break by the sequence's length, reach committed rows through a verify step's
    # rejected drafts.
    **{name: {"index_topk": 3, "index_n_heads": 16}
       for name in ("deepseek_v32", "axk2", "hy_v4", "dots3_note", "dots3_note_text")},
    "glm_moe_dsa": {"index_topk": 3, "index_n_heads": 16, "indexer_types": ["full", "shared"]},
    # MiniMax-M3's default config has no block-sparse layer, and its blocks are 128 keys with
    # 16 kept: every other of its 60 layers block-sparse, blocks of 4 keys, 2 kept (one of them
    # the local block), so the ~20-token sequences select
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"] * 30,
                           "index_block_size": 4, "index_topk_blocks": 2,
                           "index_local_blocks": 1},
    # Inkling's full layers: relative logits over 6 distances (its 1024 reach past every zoo
    # sequence), the log scaling on from position 4 (off by default), and weights of std 0.3
    # (HF's 0.02 leaves the logits near zero), so each is exercised
    "inkling_text": {"rel_extent": 6, "log_scaling_n_floor": 4, "initializer_range": 0.3},
    # Inkling 2: the same, and a block residual every 2 layers (6 by default: one block in 3)
    "inkling2_text": {"rel_extent": 6, "log_scaling_n_floor": 4, "n_layers_per_attn_res_block": 2},
    # DBRX's attention reads attn_config.rope_theta, which its default attention config lacks
    # (its model cannot build); DBRX's own values: theta 5e5, 8 KV heads (2 at tiny widths),
    # q/k/v clipped at 8
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "kv_n_heads": 2, "clip_qkv": 8.0}},
    # dots.llm1's default config leaves its experts unset (its model cannot build)
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # Qwen4-Exp's QSA indexer is all-or-nothing: every field set, one key head. Blocks of 2
    # keys and a budget of 4 blocks, so the zoo's ~20-token sequences select.
    **{name: {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
              "indexer_budget": 4, "indexer_compress_ratio": 2}
       for name in ("qwen4_exp", "qwen4_exp_text")},
    # Gemma 3n's last 15 of 35 layers read the KV of the last earlier layer of their type; cut
    # to one layer of each kind, 15 shared layers are more than there are (its config refuses
    # to build): the last 2 shared, so the first two (one of each attention type) serve them
    "gemma3n_text": {"num_kv_shared_layers": 2},
    # Dory loops its middle section (the layer count is three sections' sum, which no cut of the
    # per-layer fields keeps): two layers a section, the looped one an attention layer and an
    # MLP-only one, the two attention types each in a section of their own
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2,
             "n_output_layers": 2, "layer_types": ["sliding_attention", "mlp", "full_attention",
                                                   "mlp", "sliding_attention", "mlp"]},
    # Cohere Compass's text config (alone or in its multimodal model) defaults to no rotary
    # parameters at all (its model cannot build: they are per layer type); a checkpoint's pattern instead: sliding layers rotated
    # (multimodal sections summing to the tiny head's half), full layers without positions
    **{name: {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5e4,
                                                  "mrope_section": [4, 2, 2]},
                            "full_attention": None}}
       for name in ("cohere_compass_text", "cohere_compass")},
}
"""Per model type, fields no name rule can guess (applied to the text config last)."""

_KIND_ATTRIBUTES = ("sliding_window", "is_sliding", "attention_type", "layer_type", "use_rope",
                    "is_causal", "attention_chunk_size", "is_local", "is_global", "is_moe",
                    "is_sparse", "mixer_type", "block_type")
"""Module attributes that make one decoder layer differ from another of the same classes."""


@dataclass
class TinyConfig:
    """A tiny config and how it was made."""

    config: Any
    """The config object (its class's ``from_dict`` of the rewritten defaults)."""
    layers: int
    """Decoder layers."""
    kinds: int
    """Distinct layer kinds of the default config."""
    covered: int
    """How many of them the tiny config has."""
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """``field: (default, tiny)`` for every field the rules rewrote (text config, dotted for
    other sub-configs)."""


def _rotary_half(d: dict) -> int:
    head = d.get("qk_rope_head_dim") or SIZES["head_dim"]
    rope = d.get("rope_parameters")
    partial = d.get("partial_rotary_factor") or \
        (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or 1.0
    return max(1, int(head * partial) // 2)


def _fix_rope(rope: dict, new_half: int) -> dict:
    """Keep a rotary parameter dict consistent with the new sizes: mRoPE sections rescaled to
    the new half dim, per-frequency factor lists cut to it, and a scaled rope's original
    context set to the new positions over its factor (YaRN, Llama 3)."""
    if not isinstance(rope, dict):
        return rope
    if "rope_type" not in rope and all(isinstance(v, dict) for v in rope.values()):
        return {k: _fix_rope(v, new_half) for k, v in rope.items()}
    rope = dict(rope)
    factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
    if isinstance(factor, (int, float)) and factor > 0 and isinstance(original, int):
        # the context the scaling stretches, as the new positions over the same factor
        rope["original_max_position_embeddings"] = max(1, int(SIZES["positions"] / factor))
    for key, value in rope.items():
        if not isinstance(value, list) or not value or \
                not all(isinstance(x, (int, float)) for x in value):
            continue
        if "section" in key and all(isinstance(x, int) for x in value):
            total = sum(value)
            scaled = [max(1, round(x * new_half / total)) for x in value]
            scaled[-1] += new_half - sum(scaled)
            rope[key] = scaled
        elif "factor" in key:
            rope[key] = (value * math.ceil(new_half / len(value)))[:new_half]
    return rope


def _shrink(d: dict, changed: dict, prefix: str = "") -> dict:
    """Rewrite ``d`` (one config's ``to_dict()``) in place by the name rules; sub-config dicts
    (values with a ``model_type``) and per-layer override dicts are rewritten the same way."""
    old = dict(d)
    hidden_key = next((k for k in _HIDDEN if isinstance(d.get(k), int)), None)
    heads_key = next((k for k in _HEADS if isinstance(d.get(k), int)), None)
    old_head = d.get("head_dim") or (
        (d.get(hidden_key) or 0) // max(1, d.get(heads_key) or 1) if hidden_key else 0)
    mla = isinstance(d.get("kv_lora_rank"), int)
    has_top_k = any(isinstance(d.get(k), int) for k in _TOP_K)
    has_experts = any(isinstance(d.get(k), int) for k in _EXPERTS)

    def put(key, value):
        if d[key] != value:
            changed[prefix + key] = (d[key], value)
            d[key] = value

    for key in list(d):
        value = d[key]
        if isinstance(value, dict) and ("model_type" in value or _is_layer_dict(value)):
            if "model_type" in value:
                _shrink(value, changed, f"{prefix}{key}.")
            else:
                for layer, sub in value.items():
                    if isinstance(sub, dict):
                        _shrink(sub, changed, f"{prefix}{key}.{layer}.")
            continue
        if value is None:  # a default some models cannot build from
            if key == "head_dim" and hidden_key:
                put(key, SIZES["head_dim"])
            elif key in _KV_HEADS and "num_attention_heads" in d:
                put(key, SIZES["kv_heads"])
            elif key in _EXPERTS and has_top_k:
                put(key, SIZES["experts"])
            elif key in _TOP_K and has_experts:
                put(key, SIZES["top_k"])
            continue
        if isinstance(value, bool):
            if key == "is_decoder":
                put(key, True)  # a *ForCausalLM is the decoder
            continue
        if isinstance(value, float) and _DROPOUT.search(key):
            put(key, 0.0)
        if not isinstance(value, int):
            continue
        if key in _HIDDEN or (_ADAPTER_IN.search(key) and hidden_key
                              and value == old.get(hidden_key)):
            base = old.get(hidden_key)
            ratio = value // base if key != hidden_key and base and value % base == 0 else 1
            put(key, SIZES["hidden"] * ratio)
        elif key in _LAYERS:
            put(key, SIZES["layers"])
        elif key in _HEADS:
            put(key, SIZES["heads"])
        elif key in _KV_HEADS and mla and value == old.get(heads_key):
            put(key, SIZES["heads"])  # MLA: one KV head per query head, from the latent
        elif key in _KV_HEADS:
            put(key, min(value, SIZES["kv_heads"]))
        elif key == "head_dim" and old.get("qk_rope_head_dim") == value:
            put(key, SIZES["rope_head_dim"])  # MLA configs whose head_dim is the rotary part
        elif key in _HEAD_DIMS:
            put(key, SIZES["head_dim"])
        elif key in _ROPE_HEAD_DIMS:
            put(key, SIZES["rope_head_dim"])
        elif key == "qk_head_dim":
            put(key, SIZES["head_dim"] + SIZES["rope_head_dim"])
        elif key in _ROTARY_DIMS and old_head:
            put(key, max(2, SIZES["head_dim"] * value // old_head // 2 * 2))
        elif key in _EXPERTS:
            put(key, min(value, SIZES["experts"]))
        elif key in _TOP_K:
            put(key, min(value, SIZES["top_k"]))
        elif key in _GROUPS:
            put(key, min(value, 2))
        elif key in _AT_MOST_ONE:
            put(key, min(value, 1))
        elif key in _RANKS:
            put(key, min(value, SIZES["rank"]))
        elif key in _WINDOWS:
            put(key, min(value, SIZES["window"]))
        elif key in _POSITIONS:
            put(key, SIZES["positions"])
        elif key.endswith("vocab_size") or key == "vocab_size_per_layer_input":
            put(key, min(value, SIZES["vocab"]) if value > 0 else value)
        elif _INTERMEDIATE.search(key) and value > SIZES["intermediate"]:
            put(key, SIZES["intermediate"])
    expand = next((d[k] for k in _SSM_EXPANDS if isinstance(d.get(k), int)), None)
    ssm_heads = next((k for k in _SSM_HEADS if isinstance(d.get(k), int)), None)
    ssm_dim = next((k for k in _SSM_HEAD_DIMS if isinstance(d.get(k), int)), None)
    inner = old.get("mamba_d_ssm") or (expand * old[hidden_key] if expand and hidden_key else 0)
    if expand and ssm_heads and ssm_dim and hidden_key and \
            old.get(ssm_heads, 0) * old.get(ssm_dim, 0) == inner:
        if isinstance(d.get("mamba_d_ssm"), int):
            put("mamba_d_ssm", expand * d[hidden_key])
        put(ssm_heads, expand * d[hidden_key] // d[ssm_dim])
    for key in _ROPE_DICTS & d.keys():
        fixed = _fix_rope(d[key], _rotary_half(d))
        if fixed != d[key]:
            put(key, fixed)
    layers = next((d[k] for k in _LAYERS if isinstance(d.get(k), int) and d[k] != old[k]),
                  None)
    if layers is not None:  # per-layer override dicts past the new depth name no layer
        for key, value in list(d.items()):
            if isinstance(value, dict) and _is_layer_dict(value) and \
                    any(int(k) >= layers for k in value):
                put(key, {k: v for k, v in value.items() if int(k) < layers})
        kinds = d.get("layer_types")  # a tower's own layer kinds (the text config's are chosen
        if isinstance(kinds, list) and len(kinds) > layers:  # by tiny_config): the first ones
            put("layer_types", kinds[:layers])
    return d


def _adapters_to_text(full: dict, text_key: str, text_default: dict, changed: dict) -> None:
    """A tower's adapter output (``adapter_out_dim``), which its config checks against the
    text model's width, follows the text width where it equalled it."""
    hidden_key = next((k for k in _HIDDEN if isinstance(text_default.get(k), int)), None)
    if hidden_key is None:
        return
    for key, sub in full.items():
        if key == text_key or not isinstance(sub, dict) or "model_type" not in sub:
            continue
        for field, value in list(sub.items()):
            if _ADAPTER_OUT.search(field) and value == text_default[hidden_key]:
                changed[f"{key}.{field}"] = (value, full[text_key][hidden_key])
                sub[field] = full[text_key][hidden_key]


def _is_layer_dict(value: dict) -> bool:
    """A dict keyed by layer index (``{"05": {...}}``: per-layer overrides)."""
    return bool(value) and all(str(k).isdigit() and isinstance(v, dict)
                               for k, v in value.items())


def special_token_ids(d: dict, vocab: int) -> dict[str, Any]:
    """Move every special token id (``*_token_id(s)``, ``*_index``) at or past ``vocab`` to the
    top of the vocabulary, one new id per old id (ids that were equal stay equal), skipping
    ids already inside; returns ``field: new value`` for the fields that changed."""
    inside = {x for x in config_token_ids(d) if 0 <= x < vocab}
    moved: dict[int, int] = {}
    free = iter(range(vocab - 1, -1, -1))

    def remap(x):
        if not isinstance(x, int) or isinstance(x, bool) or x < vocab:
            return x  # inside already, or negative (none)
        if x not in moved:
            moved[x] = next(i for i in free if i not in inside)
        return moved[x]

    out = {}
    for owner, key, value in list(_walk(d)):
        if not TOKEN_ID_KEY.search(key):
            continue
        new = [remap(x) for x in value] if isinstance(value, list) else remap(value)
        if new != value:
            owner[key] = new
            out[key] = new
    return out


def _walk(d: dict):
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            yield from _walk(value)
        else:
            yield d, key, value


def _text_key(config) -> str | None:
    """The key of the text sub-config inside a composite config (None: the config is text)."""
    text = config.get_text_config()
    if text is config:
        return None
    for key in config.to_dict():
        if getattr(config, key, None) is text:
            return key
    return None


def _layer_key(config_cls, d: dict) -> str | None:
    if isinstance(d.get("decoder_layers"), int):  # encoder-decoder families: the decoder
        return "decoder_layers"
    name = getattr(config_cls, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    if name in d:
        return name
    return next((k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                             "decoder_layers") if isinstance(d.get(k), int)), None)


def _per_layer_fields(d: dict, n: int) -> tuple[list[str], list[str], list[str]]:
    """Fields of ``d`` that hold one entry per layer (lists of length ``n``), fields that hold
    layer indices (int lists named like layers, every entry ``< n``) and dicts keyed by layer
    index (``{"05": {...}}``)."""
    per, index, keyed = [], [], []
    for key, value in d.items():
        if isinstance(value, dict) and _is_layer_dict(value) and \
                all(int(k) < n and isinstance(v, dict) for k, v in value.items()):
            keyed.append(key)
        if not isinstance(value, list) or not value or key in ("architectures",):
            continue
        if _LAYER_INDEX_LIST.search(key) and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in value) \
                and value == sorted(set(value)):
            index.append(key)
        elif len(value) == n and n > 1 and not TOKEN_ID_KEY.search(key):
            per.append(key)
    return per, index, keyed


_ROUND_TRIP_KEYS = ("_name_or_path", "output_attentions")
"""Fields ``to_dict`` writes into every sub-config that some sub-config classes then refuse as
unknown (transformers 5.17's DBRX attention and FFN configs)."""


def _build(config_cls, d: dict):
    """``config_cls`` from ``d``; a config that refuses grouped KV heads (its validation wants
    as many as query heads) is built again with them equal, and ``d`` is updated to match; one
    whose sub-configs refuse the fields their own ``to_dict`` wrote is built without them."""
    try:
        return config_cls.from_dict(copy.deepcopy(d))
    except Exception as err:
        if "unknown kwargs" in str(err):
            bare = copy.deepcopy(d)
            for sub in (v for v in bare.values() if isinstance(v, dict) and "model_type" in v):
                for key in _ROUND_TRIP_KEYS:
                    sub.pop(key, None)
            config = config_cls.from_dict(copy.deepcopy(bare))
            d.clear()
            d.update(bare)
            return config
        equal = copy.deepcopy(d)
        if not _equal_kv_heads(equal):
            raise
        try:
            config = config_cls.from_dict(copy.deepcopy(equal))
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            pass
        else:
            d.clear()
            d.update(equal)
            return config
        raise


def _equal_kv_heads(d: dict) -> bool:
    """Set every KV-head count in ``d`` (sub-configs included) to its query heads; whether any
    changed."""
    changed = False
    for owner, key, value in list(_walk(d)):
        heads = next((owner[k] for k in _HEADS if isinstance(owner.get(k), int)), None)
        if key in _KV_HEADS and isinstance(value, int) and heads and value != heads:
            owner[key] = heads
            changed = True
    return changed


def decoder_stacks(model, n: int) -> list[torch.nn.ModuleList]:
    """The ``nn.ModuleList``s of ``n`` layers inside ``model``'s text decoder
    (``get_decoder()`` where the model has one, so that a vision tower of the same depth is
    left out)."""
    try:
        decoder = model.get_decoder()
    except Exception:  # noqa: BLE001 - models without the accessor: search the whole model
        decoder = None
    root = decoder if isinstance(decoder, torch.nn.Module) else model
    return [m for m in root.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]


def layer_kinds(model, n: int, per_layer: dict[str, list]) -> list[tuple]:
    """One hashable kind per decoder layer: its submodules' classes and kind attributes, plus
    its entries in the config's per-layer fields."""
    lists = decoder_stacks(model, n)
    kinds = []
    for i in range(n):
        parts = []
        for stack in lists:
            layer = stack[i]
            for name, module in layer.named_modules():
                attrs = tuple((a, _plain(getattr(module, a))) for a in _KIND_ATTRIBUTES
                              if a in vars(module) and _plain(getattr(module, a)) is not None)
                parts.append((re.sub(r"\d+", "#", name), type(module).__name__, attrs))
        parts = sorted(set(parts), key=repr)
        kinds.append((tuple(parts), tuple((k, repr(v[i])) for k, v in sorted(per_layer.items()))))
    return kinds


def _plain(value):
    if isinstance(value, (bool, int, float, str)):
        return value
    return None


def _model_on_meta(config_cls, model_cls, d: dict):
    config = _for_model(_build(config_cls, d), model_cls)
    with torch.device("meta"):
        return model_cls(config)


def tiny_config(model_type: str, model_cls=None, overrides: dict | None = None) -> TinyConfig:
    """The tiny config of ``model_type`` (a key of transformers' ``CONFIG_MAPPING``).

    ``model_cls`` (the causal-LM class) is used to read the layer kinds; without it the layer
    count stays 2 with per-layer fields cut to their first entries. ``overrides`` (text config
    fields) are applied after the rules, before the layers are chosen; :data:`OVERRIDES` of the
    model type come first."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    full = default.to_dict()
    text_key = _text_key(default)
    changed: dict[str, tuple[Any, Any]] = {}
    rope = (full[text_key] if text_key else full).get("rope_parameters")
    if model_type in MROPE_SECTIONS and isinstance(rope, dict) and "mrope_section" not in rope:
        rope["mrope_section"] = list(MROPE_SECTIONS[model_type])
    _shrink(full, changed)
    if text_key:
        _adapters_to_text(full, text_key, default.get_text_config().to_dict(), changed)
    vocab_owner = full[text_key] if text_key else full
    vocab = vocab_owner.get("vocab_size", SIZES["vocab"])
    special_token_ids(full, vocab if isinstance(vocab, int) else SIZES["vocab"])
    text = full[text_key] if text_key else full
    text.update({**OVERRIDES.get(model_type, {}), **(overrides or {})})
    layer_key = _layer_key(config_cls if not text_key else type(default.get_text_config()),
                           text)

    # the default's layer count at tiny widths; per-layer fields as the config class derives
    # them from the rewritten scalars (a window count of 1 makes layer 1 sliding)
    text_default = default.get_text_config().to_dict()
    n_full = text_default.get(layer_key) if layer_key else None
    if not isinstance(n_full, int) or not layer_key:
        return TinyConfig(_for_model(_build(config_cls, full), model_cls),
                          text.get(layer_key) or 0, 1, 1, changed)
    given = set(OVERRIDES.get(model_type, {})) | set(overrides or {})
    if layer_key in given:  # an override that sets the layer count sets the layers too
        return TinyConfig(_for_model(_build(config_cls, full), model_cls), text[layer_key], 1,
                          1, changed)
    fields = [set(f) - given for f in _per_layer_fields(text_default, n_full)]
    medium = copy.deepcopy(full)
    mtext = medium[text_key] if text_key else medium
    mtext[layer_key] = n_full
    for key in set().union(*fields):
        mtext.pop(key)
    try:
        medium_config = _build(config_cls, medium)
    except Exception:  # noqa: BLE001 - the class needs them given: keep the default's
        for key in set().union(*fields):
            mtext[key] = copy.deepcopy(text_default[key])
        try:
            medium_config = _build(config_cls, medium)
        except Exception:  # noqa: BLE001 - no full-depth config (an override's layer list)
            medium_config, model_cls = default, None
    source = medium_config.get_text_config().to_dict()
    per_keys, index_keys, keyed_keys = (
        sorted(a | set(b)) for a, b in zip(fields, _per_layer_fields(source, n_full)))
    index_keys = sorted(set(index_keys) - set(per_keys))
    for key in per_keys + index_keys + keyed_keys:
        mtext[key] = copy.deepcopy(source[key])

    def with_layers(chosen: list[int]) -> dict:
        out = copy.deepcopy(full)
        t = out[text_key] if text_key else out
        t[layer_key] = len(chosen)
        where = {old: new for new, old in enumerate(chosen)}
        for key in per_keys:
            t[key] = [source[key][i] for i in chosen]
        for key in index_keys:
            t[key] = [where[i] for i in source[key] if i in where]
        for key in keyed_keys:
            t[key] = {str(where[int(k)]).zfill(len(str(k))): v for k, v in source[key].items()
                      if int(k) in where}
        return out

    def per_layer_values(d: dict, n: int) -> dict[str, list]:
        t = d[text_key] if text_key else d
        values = {k: t[k] for k in per_keys if isinstance(t.get(k), list)}
        for key in index_keys:
            values[key] = [i in set(t.get(key) or ()) for i in range(n)]
        for key in keyed_keys:
            entries = {int(k): v for k, v in (t.get(key) or {}).items()}
            values[key] = [entries.get(i) for i in range(n)]
        return values

    try:
        want = layer_kinds(_model_on_meta(config_cls, model_cls, medium), n_full,
                           per_layer_values(medium, n_full)) if model_cls else None
    except Exception:  # noqa: BLE001 - coverage is best effort; the tiny build decides
        want = None
    if want is None:
        chosen = list(range(min(SIZES["layers"], n_full)))
        d = with_layers(chosen)
        return TinyConfig(_for_model(_build(config_cls, d), model_cls), len(chosen), 1, 1,
                          changed)

    first: dict[tuple, int] = {}
    for i, kind in enumerate(want):
        first.setdefault(kind, i)
    goal = set(want)
    candidates = []
    if per_keys or index_keys or keyed_keys:
        chosen = sorted(first.values())
        for extra in range(n_full):
            if len(chosen) >= min(SIZES["layers"], n_full):
                break
            if extra not in chosen:
                chosen = sorted(chosen + [extra])
        candidates.append(chosen)
    candidates += [list(range(n)) for n in range(min(SIZES["layers"], n_full),
                                                 min(MAX_LAYERS, n_full) + 1)]
    best = None
    for chosen in candidates:
        d = with_layers(chosen)
        try:
            got = set(layer_kinds(_model_on_meta(config_cls, model_cls, d), len(chosen),
                                  per_layer_values(d, len(chosen))))
        except Exception:  # noqa: BLE001 - a layer count this config refuses: try the next
            continue
        covered = len(goal & got)
        if best is None or covered > best[1]:
            best = (chosen, covered)
        if covered == len(goal):
            break
    chosen = best[0] if best else list(range(min(SIZES["layers"], n_full)))
    d = with_layers(chosen)
    changed[(f"{text_key}." if text_key else "") + layer_key] = (n_full, len(chosen))
    return TinyConfig(_for_model(_build(config_cls, d), model_cls), len(chosen), len(goal),
                      best[1] if best else 0, changed)


def _for_model(config, model_cls):
    """What ``model_cls`` is built from: the text sub-config when the causal LM takes only
    that (Qwen3.5's ``Qwen3_5ForCausalLM`` under the composite ``qwen3_5`` type)."""
    wants = getattr(model_cls, "config_class", None)
    text = config.get_text_config()
    if wants is not None and not isinstance(config, wants) and isinstance(text, wants):
        return text
    return config
