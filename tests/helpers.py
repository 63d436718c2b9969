"""Tiny models and drivers shared by the tests."""

from __future__ import annotations

import importlib
import random

import torch
from torch import nn

from dspark_compile import VerifyLayout
from dspark_compile.nn import CachedAttention


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module (``benchmarks`` is on pytest's ``pythonpath``)."""
    return importlib.import_module(name)


def prefill_verify_rounds(verifier, vocab: int) -> list[torch.Tensor]:
    """Prefill two requests, commit, then two verify/commit rounds; the logits and KV."""
    from dspark_compile import VerifyLayout

    state = verifier.new_state(max_requests=3, max_context=48)
    gen = torch.Generator().manual_seed(0)
    outs, ctx = [], [0, 0]
    for lens in ([5, 9], [3, 1], [2, 4]):
        layout = VerifyLayout.pack(lens, ctx, [2, 0])
        outs.append(verifier(torch.randint(0, vocab, (sum(lens),), generator=gen), layout,
                             state).clone())
        verifier.commit(layout, lens, state)
        ctx = [c + n for c, n in zip(ctx, lens)]
    return outs + [state.kv_caches[-1][0].clone()]


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 97, intermediate: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen3(seed: int = 0, layers: int = 2, vocab: int = 101):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=80,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_qwen35(seed: int = 0, vocab: int = 101,
                layer_types=("linear_attention", "full_attention", "linear_attention",
                             "full_attention")):
    """Qwen3.5 text model: Gated DeltaNet (conv + delta rule) and gated full attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=512)
    return Qwen3_5ForCausalLM(cfg).eval()


def tiny_qwen3_next(seed: int = 0, vocab: int = 101,
                    layer_types=("linear_attention", "full_attention", "linear_attention",
                                 "full_attention")):
    """Qwen3-Next: Gated DeltaNet and gated attention layers, each with a sparse MoE (4 experts,
    top 2, and a gated shared expert)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=512)
    return Qwen3NextForCausalLM(cfg).eval()


class PlainBlock(nn.Module):
    """A pre-norm decoder block written as free-form torch around CachedAttention."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.attn = CachedAttention(heads, kv_heads, self.head_dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def rotate(self, x, positions):  # x [bs, T, heads, D], positions [bs, T]
        half = self.head_dim // 2
        freq = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
        angle = positions.unsqueeze(-1).float() * freq  # [bs, T, half]
        cos, sin = angle.cos().unsqueeze(2), angle.sin().unsqueeze(2)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x, positions):
        bs, t, _ = x.shape
        h = self.qkv(self.norm1(x))
        q, k, v = h.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                           self.kv_heads * self.head_dim], dim=-1)
        q = self.rotate(q.view(bs, t, self.heads, self.head_dim), positions)
        k = self.rotate(k.view(bs, t, self.kv_heads, self.head_dim), positions)
        v = v.view(bs, t, self.kv_heads, self.head_dim)
        x = x + self.proj(self.attn(q, k, v).reshape(bs, t, -1))
        return x + self.mlp(self.norm2(x))


class PlainDecoder(nn.Module):
    """``forward(input_ids [bs, T], positions [bs, T]) -> logits [bs, T, V]``."""

    def __init__(self, vocab: int = 61, dim: int = 32, heads: int = 4, kv_heads: int = 2,
                 layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, positions):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x))


def full_logits(model, seq: torch.Tensor) -> torch.Tensor:
    """The model's own forward over one whole sequence: ``[len, V]`` (the external oracle)."""
    with torch.no_grad():
        if isinstance(model, PlainDecoder):
            return model(seq[None], torch.arange(seq.numel(), device=seq.device)[None])[0]
        return model(seq[None], use_cache=False).logits[0]


class Session:
    """Drives a verifier through prefill and verify/commit rounds, checking every row."""

    def __init__(self, model, verifier, slots, max_context=128, seed=0, device="cpu",
                 **state_kwargs):
        self.model, self.verifier, self.slots = model, verifier, list(slots)
        self.state = verifier.new_state(max_requests=max(slots) + 1, max_context=max_context,
                                        **state_kwargs)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = None
        self.seqs: list[torch.Tensor] = []
        self.max_err = 0.0
        self.device = torch.device(device)

    def tokens(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (n,), generator=self.gen)

    def step(self, lens, accept=None):
        """Run one packed forward of ``lens`` new tokens per request and check every row."""
        context = [s.numel() for s in self.seqs] or [0] * len(lens)
        new = [self.tokens(n) for n in lens]
        layout = VerifyLayout.pack(lens, context, self.slots)
        logits = self.verifier(torch.cat(new).to(self.device), layout, self.state).cpu()
        qsl = layout.query_start_loc.tolist()
        for i, n in enumerate(lens):
            prefix = self.seqs[i] if self.seqs else torch.empty(0, dtype=torch.int64)
            want = full_logits(self.model, torch.cat([prefix, new[i]]).to(self.device))[-n:]
            want = want.cpu()
            self.max_err = max(self.max_err, (logits[qsl[i]:qsl[i + 1]] - want).abs().max().item())
        accept = accept or [self.rng.randint(1, n) for n in lens]
        self.verifier.commit(layout, accept, self.state)
        if not self.seqs:
            self.seqs = [torch.empty(0, dtype=torch.int64) for _ in lens]
        self.seqs = [torch.cat([s, t[:a]]) for s, t, a in zip(self.seqs, new, accept)]
        return logits, layout


def prefill_and_rounds(model, verifier, vocab: int) -> float:
    """Prefill three requests (9-11 tokens, slots out of order), then three ragged
    verify/commit rounds; the max |ragged - HF| over every verified row."""
    session = Session(model, verifier, [2, 0, 1], seed=1)
    session.vocab = vocab
    session.step([9, 11, 10], accept=[9, 11, 10])
    for lens in ([3, 2, 4], [4, 1, 3], [2, 4, 1]):
        session.step(lens)
    return session.max_err


VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_deepstack")


def tiny_vl(family: str, seed: int = 0, vocab: int = 64):
    """A tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL (random weights; special ids at the top of the
    vocabulary: vision start/end ``vocab-5``/``vocab-4``, image ``vocab-3``, video
    ``vocab-2``). mRoPE sections [2, 3, 3] over head_dim 16; ``qwen3_vl`` without DeepStack,
    ``qwen3_vl_deepstack`` with its one vision block's features added after text layer 0,
    ``qwen3_vl_deepstack3`` with three blocks' features over the two text layers."""
    import transformers as tf

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters=rope, head_dim=16)
    vision = dict(depth=1, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64)
        config_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    elif family == "qwen2_5_vl":
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=48, window_size=16,
                      fullatt_block_indexes=[0])
        config_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen3_vl_deepstack3":  # three maps over two text layers: HF drops one
        vision.update(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1, 2])
        config_cls, model_cls = tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration
    else:
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=48,
                      num_position_embeddings=16,
                      deepstack_visual_indexes=[0] if family.endswith("deepstack") else [])
        config_cls, model_cls = tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=vocab - 3,
                     video_token_id=vocab - 2, vision_start_token_id=vocab - 5,
                     vision_end_token_id=vocab - 4)
    return model_cls(cfg).eval()


def packed_graph(model, dtype=torch.float32, device_type: str = "cpu", stages=("ragged",),
                 **config):
    """``model``'s dense capture (on the CPU) run through the pass pipeline's ``stages`` with
    ``DSparkConfig(**config)`` resolved for ``device_type`` (``"cuda"``: the Triton lowering's
    passes, nothing runs). Returns the graph and the pass context."""
    from dspark_compile import DSparkConfig
    from dspark_compile.frontend.adapters import adapter_for
    from dspark_compile.frontend.capture import capture_dense
    from dspark_compile.passes import PassContext, run_pipeline

    captured = capture_dense(adapter_for(model), dtype, torch.device("cpu"))
    ctx = PassContext(captured.bs, captured.tokens, list(captured.inputs),
                      DSparkConfig(**config).resolve(device_type))
    gm, _ = run_pipeline(captured.gm, ctx, stages=stages)
    return gm, ctx


def randomised(model, keep: tuple[str, ...] = ("ln", "norm", "LayerNorm")):
    """``model`` in eval mode with every parameter whose name holds none of ``keep`` (the
    norms) drawn from N(0, 0.2) (seed 1): HF's 0.02 init leaves tiny models' logits near zero,
    where a wrong capture could still pass."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(k in name for k in keep):
                p.normal_(0.0, 0.2)
    return model.eval()


def ragged_rounds_error(model, verifier, slots, prompts, vocab: int, seed: int, rounds: int = 4,
                        max_len: int = 8, device: str = "cpu", max_context: int = 128) -> float:
    """Prefill ``prompts`` (all accepted), then ``rounds`` ragged verify/commit rounds of random
    lengths 1..max_len; the max |ragged - HF| over every verified row (tokens below ``vocab``)."""
    session = Session(model, verifier, slots, max_context=max_context, seed=seed, device=device)
    session.vocab = vocab
    session.step(prompts, accept=prompts)
    rng = random.Random(seed)
    for _ in range(rounds):
        session.step([rng.randint(1, max_len) for _ in slots])
    return session.max_err


def triton_rounds_error(model, slots, prompts, vocab: int, seed: int, **kwargs) -> float:
    """:func:`ragged_rounds_error` of ``model`` moved to the GPU and compiled with the Triton
    lowering."""
    from dspark_compile import dspark_compile

    model = model.cuda()
    return ragged_rounds_error(model, dspark_compile(model, lowering="triton"), slots, prompts,
                               vocab, seed, device="cuda", **kwargs)


def assert_nan_drafts_contained(model, verifier, poison: int, slots, prompts, lens, accept,
                                seed: int = 0, capture: bool = False) -> None:
    """A token whose embedding row is NaN at every rejected draft position (``lens[i]`` drafts,
    ``accept[i]`` accepted): the accepted rows and the committed linear-layer state are
    bit-identical to a clean run. ``capture``: both sessions run through a captured session's
    static buffers and commit (CPU, no graphs): the same padded shapes, since a CPU BLAS may
    round a row differently when the matrix around it has another row count (MKL on an AMD
    EPYC does: ``x[:1] @ w`` is not ``(x[:9] @ w)[:1]`` bit for bit)."""
    gen = torch.Generator().manual_seed(seed)
    states = [verifier.new_state(max_requests=max(slots) + 1, max_context=64) for _ in range(2)]
    if capture:
        for state in states:
            verifier.capture(state, block=max(8, max(lens)), use_graphs=False)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        saved = embed[poison].clone()
        embed[poison] = float("nan")
    try:
        prompt = [torch.randint(0, poison, (n,), generator=gen) for n in prompts]
        for state in states:
            layout = VerifyLayout.pack(list(prompts), [0] * len(slots), slots)
            verifier(torch.cat(prompt), layout, state)
            verifier.commit(layout, list(prompts), state)
        clean = [torch.randint(0, poison, (n,), generator=gen) for n in lens]
        dirty = [torch.cat([c[:a], torch.full((n - a,), poison)])
                 for c, a, n in zip(clean, accept, lens)]
        outs = []
        for state, tokens in zip(states, (clean, dirty)):
            layout = VerifyLayout.pack(list(lens), list(prompts), slots)
            outs.append(verifier(torch.cat(tokens), layout, state).clone())
            verifier.commit(layout, list(accept), state)
        qsl = layout.query_start_loc.tolist()
        for i, a in enumerate(accept):
            rows = slice(qsl[i], qsl[i] + a)
            assert torch.equal(outs[0][rows], outs[1][rows]), f"request {i}"
        if any(a < n for a, n in zip(accept, lens)):
            assert not torch.isfinite(outs[1]).all(), "the poison token must produce NaN"
        linear = [(*s.linear.conv_states, *s.linear.recurrent_states) for s in states]
        for a, b in zip(*linear):
            assert torch.equal(a, b)
    finally:
        with torch.no_grad():
            embed[poison] = saved


def paged_step(contexts, lens, page: int, pages: int, per: int, gen: torch.Generator,
               pad_rows: int = 0):
    """One ragged step's metadata over a pool of ``pages`` pages of ``page`` rows:
    ``(query_start_loc, seq_lens, block_table, slot_mapping)`` (CPU tensors). Request ``i`` has
    ``lens[i]`` new tokens after ``contexts[i]``; its ``per`` pages are drawn scattered
    (``randperm(pages)``); ``pad_rows`` padding rows follow, slot -1."""
    r = len(lens)
    table = torch.randperm(pages, generator=gen)[: r * per].view(r, per).to(torch.int32)
    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    slots = torch.full((int(qsl[-1]) + pad_rows,), -1, dtype=torch.int64)
    for i, (c, length) in enumerate(zip(contexts, lens)):
        pos = torch.arange(c, c + length)
        slots[int(qsl[i]):int(qsl[i]) + length] = table[i].long()[pos // page] * page + pos % page
    seq_lens = torch.tensor([c + m for c, m in zip(contexts, lens)], dtype=torch.int32)
    return qsl, seq_lens, table, slots


def with_forward(module, forward) -> None:
    """Give ``module`` a class of its own (named as its class) whose ``forward`` is ``forward``:
    how a test writes a variant of a model's module, since a forward set on the instance is
    refused at the build like a hook."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"forward": forward,
                                                   "__module__": cls.__module__})
