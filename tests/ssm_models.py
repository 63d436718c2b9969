"""Tiny float32 state-space hybrids (random weights) for the Mamba-2 family tests.

Every Mamba-2 mixer has H = 4 heads of P = 16 channels, G = 2 groups of N = 8 state channels
(so B and C are shared by two heads each), a width-4 conv and HF chunk size 4 (HF's own forward
then crosses chunk boundaries inside every prompt, which the token-serial op never does: the
comparison is between two different algorithms). As few layers as cover each family's kinds:
one Mamba-2 mixer and one attention layer where the family has attention.
"""

from __future__ import annotations

import torch

VOCAB = 101
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, tie_word_embeddings=False)
_ATTENTION = dict(intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256)

FAMILIES = ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")
"""The Mamba-2 families transformers 5.x implements with ``mamba2_chunk_scan``."""
MAMBA1 = ("mamba", "falcon_mamba", "jamba")
"""Mamba-1 families (``mamba_selective_scan``, one scan a mixer)."""


def tiny_ssm(family: str, seed: int = 0):
    """A tiny ``family`` causal LM (one of :data:`FAMILIES` or :data:`MAMBA1`, or ``"lfm2"``)."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "mamba2":
        cfg = tf.Mamba2Config(num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2,
                              conv_kernel=4, num_hidden_layers=1, chunk_size=4, **_COMMON)
        return tf.Mamba2ForCausalLM(cfg).eval()
    if family == "bamba":
        cfg = tf.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA, **_ATTENTION,
                             **_COMMON)
        return tf.BambaForCausalLM(cfg).eval()
    if family == "falcon_h1":  # every layer runs attention and a Mamba-2 mixer side by side
        cfg = tf.FalconH1Config(num_hidden_layers=1, head_dim=8, mamba_d_ssm=64, **_MAMBA,
                                **_ATTENTION, **_COMMON)
        return tf.FalconH1ForCausalLM(cfg).eval()
    if family == "granitemoehybrid":
        cfg = tf.GraniteMoeHybridConfig(
            layer_types=["mamba", "attention"], num_hidden_layers=2, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=32, **_MAMBA, **_ATTENTION,
            **_COMMON)
        return tf.GraniteMoeHybridForCausalLM(cfg).eval()
    if family == "nemotron_h":
        cfg = tf.NemotronHConfig(
            layers_block_type=["mamba", "attention"], head_dim=8, ssm_state_size=8,
            mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2,
            chunk_size=4, **_ATTENTION, **_COMMON)
        return tf.NemotronHForCausalLM(cfg).eval()
    if family == "zamba2":  # a hybrid layer: the shared transformer block, then its mixer
        cfg = tf.Zamba2Config(
            num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1],
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4,
            chunk_size=4, use_mem_rope=True, **{**_ATTENTION, "num_key_value_heads": 4},
            **_COMMON)
        return tf.Zamba2ForCausalLM(cfg).eval()
    small = dict(**_ATTENTION, **_COMMON, num_hidden_layers=2)
    if family == "lfm2":  # a short gated conv layer and an attention layer
        return tf.Lfm2ForCausalLM(tf.Lfm2Config(**small,
                                                layer_types=["conv", "full_attention"])).eval()
    if family == "jamba":  # Mamba-1
        return tf.JambaForCausalLM(tf.JambaConfig(
            **small, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
            mamba_d_state=8, mamba_dt_rank=8)).eval()
    if family == "zamba":  # Mamba-1 mixers of two heads (a scan each) and a shared attention
        return tf.ZambaForCausalLM(tf.ZambaConfig(
            vocab_size=VOCAB, hidden_size=32, attention_hidden_size=64, intermediate_size=48,
            num_hidden_layers=3, num_attention_heads=4, attention_head_dim=16,
            num_key_value_heads=4, n_mamba_heads=2, attn_layer_period=2, attn_layer_offset=1,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
            max_position_embeddings=256, tie_word_embeddings=False)).eval()
    mamba1 = dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8,
                  num_hidden_layers=2, **_COMMON)
    if family == "mamba":
        return tf.MambaForCausalLM(tf.MambaConfig(**mamba1)).eval()
    if family == "falcon_mamba":  # RMS norms on B, C and dt before the scan
        return tf.FalconMambaForCausalLM(tf.FalconMambaConfig(**mamba1)).eval()
    raise KeyError(family)
