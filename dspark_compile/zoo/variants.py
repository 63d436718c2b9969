"""Config variants: each model type again under the switches real checkpoints of its family
turn (``python -m dspark_compile zoo --variants``).

The zoo's tiny config keeps a model type's defaults, but checkpoints differ from them: biases on
or off, one KV head, a head dim unlike ``hidden / heads``, a scaled rotary, a window shorter than
the sequence, logit softcaps. A variant sets one such switch (a field the type's text config
has) on top of the tiny rules, so each one checks a code path the default leaves dark. Every
variant must come out exact or refused by name; none may be wrong.

The variants, by name (applied only where the config has the field):

- ``bias``, ``mlp_bias``: ``attention_bias`` / ``mlp_bias`` on;
- ``tied``: ``tie_word_embeddings`` flipped;
- ``mqa``: one KV head; ``mha``: as many KV heads as query heads; ``group7``: 7 query heads
  of 16 on one KV head, width 112 (a GQA group that is no power of two, as Qwen2.5-7B's
  28 / 4);
  ``hidden96``: a width of 96 with 6 heads on 2 KV heads (a hidden size that is no power of
  two, as 3584 or 5120 are);
- ``head_dim32``, ``head_dim24``: a head dim of 32 (twice ``hidden / heads``) or 24 (not a
  power of two: the kernels pad it, as for checkpoints with heads of 80, 96 or 192);
- ``vocab131``: a vocabulary of 131 rows (odd, not a multiple of any tile);
- ``gelu_tanh``: ``hidden_act = "gelu_pytorch_tanh"``;
- ``partial_rope``: ``partial_rotary_factor = 0.5``;
- ``rope_linear``, ``rope_yarn``, ``rope_llama3``: scaled rotaries with an original context
  (8) shorter than the sequences; ``rope_dynamic``: NTK scaling past an 8-position context,
  which must be refused (its frequencies follow the batch's longest position);
  ``rope_longrope``: longrope's short factors (and an attention factor) below a 64-position
  original context, the zoo states' whole context;
- ``window5``: a sliding window of 5 (switched on where the config has a switch; GPT-Neo's
  ``window_size``);
- ``heads6``: 6 heads over a width of 96 where the config names no KV heads (a head count no
  power of two: ALiBi's second slope series, and the old families' head split);
- ``clip_qkv``: q/k/v clamped at 0.5 (OLMo, and MPT's and DBRX's attention configs, MPT's
  softmax scale set to 0.2 beside it);
- ``final_softcap``, ``attn_softcap``: logit softcaps of 3 and 2;
- ``eps``: an RMSNorm or LayerNorm epsilon of 0.01 (a wrong epsilon shows at that size);
- ``conv3``, ``conv2``: causal-conv windows of 3 and 2 (Mamba, Mamba-2, Gated DeltaNet, short
  conv; most checkpoints use 4, LFM2 3);
- ``groups2``: two Mamba-2 B/C groups; ``gdn_key_heads1``: one Gated DeltaNet key head shared
  by every value head;
- ``top1``, ``norm_topk``, ``route_groups``, ``group_limited``, ``shared2``, ``route_scale``:
  one expert a token, the top-k weights' renormalisation flipped, DeepSeek-V3's grouped routing
  (2 groups, the best one), DeepSeek-V2's group-limited greedy routing, two shared experts, a
  routed scaling factor of 2.5 (0.5 where it is 2.5);
- ``no_q_lora``: MLA without the query LoRA (DeepSeek-V2-Lite);
- ``multipliers``, ``qscale``, ``logit_scale``, ``<switch>_on`` / ``_off``: muP multipliers
  (Granite, Falcon-H1) away from 1, Gemma's query scalar apart from the head dim, Cohere's logit
  scale, and the q/k norm, attention-temperature, embedding-scale (``scale_embedding``) and
  MPT's ``no_bias`` switches flipped.
"""

from __future__ import annotations

from .check import Entry
from .tiny import _HEADS, _HIDDEN, _KV_HEADS, OVERRIDES, SIZES

__all__ = ["variant_entries", "combo_entries"]

_TOKEN_TABLES = ("vocab_size_per_layer_input",)
"""Other embedding tables indexed by the token ids: where one is as long as the vocabulary, the
``vocab131`` variant resizes it too (a longer vocabulary alone would draw ids past its end)."""
ORIGINAL_CONTEXT = 8
"""The original context of the scaled rotaries (the zoo's sequences run to 19 tokens)."""

LONGROPE_CONTEXT = 64
"""The original context of ``rope_longrope``: the zoo's states' ``max_context``, so its short
factors serve every position (longrope is taken below its original context only)."""


def _rotary_half_of(text: dict) -> int:
    """Half the rotary channels of a text config once the tiny rules have shrunk it, as
    transformers' longrope counts them (the head dim, the rotary part of an MLA head, times the
    partial factor): the length of its factor lists."""
    head = SIZES["rope_head_dim"] if text.get("qk_rope_head_dim") else SIZES["head_dim"]
    rope = text.get("rope_parameters")
    partial = text.get("partial_rotary_factor") or \
        (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or 1.0
    return int(head * partial) // 2


_TYPE_KEYS = frozenset({
    "type", "rope_type", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "low_freq_factor", "high_freq_factor", "attention_factor", "long_factor", "short_factor",
    "long_mscale", "short_mscale", "truncate"})
"""Rotary fields that belong to a scaling type: a variant replaces them with its own type's."""


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _rope(base) -> dict:
    """The rotary dict a variant starts from: the model's own fields less its scaling type's
    (theta, a partial factor, mRoPE sections, and fields the model reads outside the rotary,
    as Ministral 3's Llama-4 attention scaling reads ``llama_4_scaling_beta`` and the original
    context)."""
    base = base if isinstance(base, dict) and ("rope_type" in base or "type" in base) else {}
    kept = {k: v for k, v in base.items() if k not in _TYPE_KEYS}
    kept.setdefault("rope_theta", 10000.0)
    return kept


def _scaled_rope(value, kind: dict) -> dict:
    """The rotary field with ``kind`` (a scaled type) in it. A field keyed by layer type (Gemma 3
    and 4: ``{"sliding_attention": {...}, "full_attention": {...}}``) scales the full-attention
    layers' rotary and keeps the others', as those checkpoints do (where the full layers have
    none, the others are scaled)."""
    if isinstance(value, dict) and value and all(v is None or isinstance(v, dict)
                                                 for v in value.values()):
        rotated = {layer for layer, rope in value.items() if rope is not None}
        scale = {"full_attention"} & rotated or rotated  # Beam's full layers have no rotary
        return {layer: {**_rope(rope), **kind} if layer in scale else rope
                for layer, rope in value.items()}
    return {**_rope(value), **kind}


def _overrides(text: dict) -> list[tuple[str, tuple]]:
    """``(variant, overrides)`` for a text config's fields (``text``: its ``to_dict()``)."""
    out = []
    if "attention_bias" in text:
        out.append(("bias", (("attention_bias", True),)))
    if "mlp_bias" in text:
        out.append(("mlp_bias", (("mlp_bias", True),)))
    if isinstance(text.get("tie_word_embeddings"), bool):
        out.append(("tied", (("tie_word_embeddings", not text["tie_word_embeddings"]),)))
    if "num_key_value_heads" in text:
        out.append(("mqa", (("num_key_value_heads", 1),)))
        if "num_attention_heads" in text:  # the tiny rules give every config SIZES["heads"]
            out.append(("mha", (("num_key_value_heads", SIZES["heads"]),)))
        if "head_dim" in text and "num_attention_heads" in text:
            out.append(("group7", (("hidden_size", 112), ("num_attention_heads", 7),
                                   ("num_key_value_heads", 1), ("head_dim", 16))))
            out.append(("hidden96", (("hidden_size", 96), ("num_attention_heads", 6),
                                     ("num_key_value_heads", 2), ("head_dim", 16))))
    if "head_dim" in text:
        out.append(("head_dim32", (("head_dim", 32),)))
        out.append(("head_dim24", (("head_dim", 24),)))
    if "vocab_size" in text:  # with every table the token ids index (Gemma 4's per-layer one)
        out.append(("vocab131", tuple((k, 131) for k in ("vocab_size", *_TOKEN_TABLES)
                                      if k in text and text[k] == text["vocab_size"])))
    if "hidden_act" in text:
        out.append(("gelu_tanh", (("hidden_act", "gelu_pytorch_tanh"),)))
    if "partial_rotary_factor" in text:
        out.append(("partial_rope", (("partial_rotary_factor", 0.5),)))
    key = next((k for k in ("rope_parameters", "rope_scaling") if k in text), None)
    if key is not None:
        original = {"original_max_position_embeddings": ORIGINAL_CONTEXT}
        scaled = {
            "rope_linear": {"rope_type": "linear", "factor": 2.0},
            "rope_yarn": {"rope_type": "yarn", "factor": 4.0, **original},
            "rope_llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, **original},
            "rope_dynamic": {"rope_type": "dynamic", "factor": 2.0}}
        half = _rotary_half_of(text)
        if half:  # short factors below a context past the zoo's states, long ones above it
            scaled["rope_longrope"] = {
                "rope_type": "longrope", "factor": 4.0, "attention_factor": 1.25,
                "short_mscale": 1.125, "long_mscale": 1.5,  # PhiMoE's own cos/sin scales
                "short_factor": [1.0 + i / half for i in range(half)],
                "long_factor": [4.0 + 2.0 * i for i in range(half)],
                "original_max_position_embeddings": LONGROPE_CONTEXT}
        for name, kind in scaled.items():
            extra = (("max_position_embeddings", ORIGINAL_CONTEXT),) \
                if name == "rope_dynamic" else ()
            out.append((name, ((key, _scaled_rope(text.get(key), kind)),) + extra))
    if "sliding_window" in text:
        switch = (("use_sliding_window", True),) if "use_sliding_window" in text else ()
        out.append(("window5", (("sliding_window", 5),) + switch))
    elif _count(text.get("window_size")):  # GPT-Neo's local layers
        out.append(("window5", (("window_size", 5),)))
    heads = next((k for k in _HEADS if _count(text.get(k))), None)
    hidden = next((k for k in _HIDDEN if _count(text.get(k))), None)
    if not _KV_HEADS & text.keys() and heads and hidden:
        out.append(("heads6", ((hidden, 96), (heads, 6))))
    if "clip_qkv" in text:
        out.append(("clip_qkv", (("clip_qkv", 0.5),)))
    attn = text.get("attn_config")
    if isinstance(attn, dict) and "clip_qkv" in attn:  # MPT, DBRX
        scale = {"softmax_scale": 0.2} if "softmax_scale" in attn else {}
        out.append(("clip_qkv", (("attn_config", {**attn, "clip_qkv": 0.5, **scale}),)))
    if "final_logit_softcapping" in text:
        out.append(("final_softcap", (("final_logit_softcapping", 3.0),)))
    if "attn_logit_softcapping" in text:
        out.append(("attn_softcap", (("attn_logit_softcapping", 2.0),)))
    eps = tuple((k, 1e-2) for k in ("rms_norm_eps", "layer_norm_eps")
                if isinstance(text.get(k), float))
    if eps:
        out.append(("eps", eps))
    convs = [k for k in _CONV_WIDTHS if isinstance(text.get(k), int)]
    if convs:
        out.append(("conv3", tuple((k, 3) for k in convs)))
        out.append(("conv2", tuple((k, 2) for k in convs)))
    groups = [k for k in _SSM_GROUPS if isinstance(text.get(k), int)]
    if groups:
        out.append(("groups2", tuple((k, 2) for k in groups)))
    if isinstance(text.get("linear_num_key_heads"), int):
        out.append(("gdn_key_heads1", (("linear_num_key_heads", 1),)))
    out += _moe_overrides(text)
    out += _scale_overrides(text)
    if text.get("q_lora_rank"):  # DeepSeek-V2-Lite's MLA projects q without a LoRA
        out.append(("no_q_lora", (("q_lora_rank", None),)))
    return out


def _multiplier(step: int) -> float:
    """The ``step``-th multiplier of a variant: 0.61, 0.67, ... never 1.0 (0.55 + 0.06 k)."""
    return round(0.55 + 0.06 * step, 4)


def _scale_overrides(text: dict) -> list[tuple[str, tuple]]:
    """Scalings checkpoints set away from the defaults the tiny configs keep: Granite's and
    Falcon-H1's muP multipliers (every ``*_multiplier`` / ``*_multipliers`` field and
    ``logits_scaling``, each to its own value: at 1.0 a lost multiplier cannot show), Gemma's
    ``query_pre_attn_scalar`` apart from the head dim, Cohere's ``logit_scale``, and the q/k norm
    and Llama 4 attention-temperature switches flipped."""
    out = []
    mults, step = [], 0
    for key in sorted(text):
        value = text[key]
        if key.endswith("multiplier") and isinstance(value, (int, float)) and \
                not isinstance(value, bool):
            step += 1
            mults.append((key, _multiplier(step)))
        elif key.endswith("multipliers") and isinstance(value, list) and value:
            mults.append((key, [_multiplier(step + i + 1) for i in range(len(value))]))
            step += len(value)
    if isinstance(text.get("logits_scaling"), (int, float)):
        mults.append(("logits_scaling", 4.0))
    if mults:
        out.append(("multipliers", tuple(mults)))
    if isinstance(text.get("query_pre_attn_scalar"), (int, float)):
        out.append(("qscale", (("query_pre_attn_scalar", 24),)))
    if isinstance(text.get("logit_scale"), float):
        out.append(("logit_scale", (("logit_scale", 0.25),)))
    flips = tuple((k, not text[k]) for k in ("use_qk_norm", "qk_layernorm", "use_qk_layernorm",
                                             "attn_temperature_tuning", "scale_embedding",
                                             "no_bias")
                  if isinstance(text.get(k), bool))
    for key, value in flips:
        out.append((f"{key}_{'on' if value else 'off'}", ((key, value),)))
    return out


def _moe_overrides(text: dict) -> list[tuple[str, tuple]]:
    """Routing switches MoE checkpoints turn: one expert a token (Llama 4), the top-k weights
    renormalised or not, DeepSeek's grouped routing (2 groups, the best 1), a routed scaling
    factor."""
    out = []
    topk = next((k for k in ("num_experts_per_tok", "moe_topk") if isinstance(text.get(k), int)
                 and text[k] > 1), None)
    if topk is not None:
        out.append(("top1", ((topk, 1),)))
    if isinstance(text.get("norm_topk_prob"), bool):
        out.append(("norm_topk", (("norm_topk_prob", not text["norm_topk_prob"]),)))
    if "n_group" in text and "topk_group" in text:
        out.append(("route_groups", (("n_group", 2), ("topk_group", 1))))
    if text.get("topk_method") == "greedy" and "n_group" in text:  # DeepSeek-V2's own routing
        out.append(("group_limited", (("topk_method", "group_limited_greedy"), ("n_group", 2),
                                      ("topk_group", 1))))
    shared = next((k for k in ("n_shared_experts", "num_shared_experts")
                   if isinstance(text.get(k), int)), None)
    if shared is not None:  # DeepSeek-V2 has two shared experts
        out.append(("shared2", ((shared, 2),)))
    if isinstance(text.get("routed_scaling_factor"), (int, float)):
        out.append(("route_scale", (("routed_scaling_factor", 2.5 if text[
            "routed_scaling_factor"] != 2.5 else 0.5),)))
    return out


_CONV_WIDTHS = ("conv_kernel", "mamba_d_conv", "linear_conv_kernel_dim", "conv_L_cache")
"""Causal-conv widths of the state-space and linear-attention families."""
_SSM_GROUPS = ("n_groups", "mamba_n_groups", "mamba_ngroups")
"""Mamba-2 B/C group counts."""


def variant_entries(entries: list[Entry]) -> list[Entry]:
    """The variants of every model type among ``entries`` (each type once, after the entries
    of that type); a type whose default config cannot be built gets none."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out, seen = [], set()
    for entry in entries:
        out.append(entry)
        if entry.model_type in seen or entry.model_type not in CONFIG_MAPPING:
            continue
        seen.add(entry.model_type)
        try:
            text = CONFIG_MAPPING[entry.model_type]().get_text_config().to_dict()
        except Exception:  # noqa: BLE001 - a config that cannot be built has no variants
            continue
        for key, value in OVERRIDES.get(entry.model_type, {}).items():  # a variant that sets
            base = text.get(key)  # a whole sub-config (MPT's, DBRX's attn_config) keeps these
            text[key] = {**base, **value} if isinstance(base, dict) and \
                isinstance(value, dict) else value
        out += [Entry(entry.model_type, entry.architecture, name, overrides)
                for name, overrides in _overrides(text)]
    return out


REFUSED_VARIANTS = frozenset({"rope_dynamic"})
"""Variants that must come out refused (``rope_dynamic``): left out of the combinations, where
they would only hide the switches beside them."""


def combo_entries(entries: list[Entry], count: int, seed: int, size: int = 3) -> list[Entry]:
    """``count`` combinations of each model type among ``entries`` (its variants ``size`` at a
    time where the type has that many that set disjoint fields): the switches meet as checkpoints
    turn several at once (a window with one KV head and an odd head dim, a scaled rotary with a
    softcap and biases...). Drawn with ``random.Random(seed)`` per type, so a combination is
    reproduced by its seed; named ``a+b+c``; a type's repeated draws are dropped."""
    import random

    out, seen = [], set()
    for entry in entries:
        if entry.variant or entry.model_type in seen:
            continue
        seen.add(entry.model_type)
        pool = [e for e in variant_entries([entry])[1:] if e.variant not in REFUSED_VARIANTS]
        rng = random.Random(f"{seed}:{entry.model_type}")
        names = set()
        for _ in range(count * 4):  # draws that collide on a field or repeat are redrawn
            if len(names) == count or len(pool) < 2:
                break
            picked, keys = [], set()
            for cand in rng.sample(pool, len(pool)):
                cand_keys = {k for k, _ in cand.overrides}
                if cand_keys & keys:
                    continue
                picked.append(cand)
                keys |= cand_keys
                if len(picked) == size:
                    break
            name = "+".join(sorted(e.variant for e in picked))
            if len(picked) < 2 or name in names:
                continue
            names.add(name)
            overrides = tuple(kv for e in sorted(picked, key=lambda e: e.variant)
                              for kv in e.overrides)
            out.append(Entry(entry.model_type, entry.architecture, name, overrides))
    return out
