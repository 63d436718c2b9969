"""With ``new_state(window_rings=True)`` sliding-window layers keep their KV in rings of
``window + max_step_tokens - 1`` positions per slot (``state.pools.window_rings``): the pools shrink, every verified row still equals HF's
forward long after the context has wrapped the ring several times (windowed and full layers
mixed, softcap, sinks with experts), rows the window no longer sees may hold anything (NaN
included), and a step longer than the rings were sized for is refused before it runs."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.specs import AttentionSpec
from dspark_compile.state.pools import VerifierState, window_rings
from helpers import Session

T = pytest.importorskip("transformers")

VOCAB, WINDOW, PAGE, STEP = 96, 5, 4, 8
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(sliding_window=WINDOW, head_dim=16,
                                                         final_logit_softcapping=None)),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(
        sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
}


def _build(name: str):
    config_cls, model_cls, extra = MODELS[name]
    torch.manual_seed(0)
    return model_cls(config_cls(**{**BASE, **extra})).eval()


def test_ring_pages_and_page_map():
    specs = [AttentionSpec(2, 16, window=5), AttentionSpec(2, 16), AttentionSpec(2, 16, window=9),
             AttentionSpec(2, 16, window=5)]
    assert window_rings(specs, 32, 4, None) == {}
    assert window_rings(specs, 32, 4, 8) == {5: 3, 9: 4}  # ceil(12 / 4), ceil(16 / 4)
    assert window_rings(specs, 3, 4, 8) == {}  # no ring smaller than 3 pages
    state = VerifierState.allocate(specs, 3, 128, 4, torch.float32, torch.device("cpu"), 8)
    assert [k.shape[0] for k, _ in state.kv_caches] == [9, 96, 12, 9]
    assert set(state.window_maps) == {5, 9} and state.window_step_tokens == 8
    for window, ring in ((5, 3), (9, 4)):
        page_map = state.window_maps[window]
        for slot in range(3):
            got = page_map[state.block_table[slot].long()]
            want = slot * ring + torch.arange(32) % ring
            assert torch.equal(got, want.int())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rings_exact_vs_hf_long_after_wrapping(name):
    """A prefill of 8 and 14 ragged rounds (contexts past 40: the 12-position ring of window 5
    wraps three times), random accepts, pools 4x smaller than the full ones."""
    model = _build(name)
    verifier = dspark_compile(model)
    session = Session(model, verifier, [1, 0], max_context=128, seed=3, page_size=PAGE,
                      max_step_tokens=STEP, window_rings=True)
    session.vocab = VOCAB
    ring = math.ceil((WINDOW + STEP - 1) / PAGE)
    windowed = [s.window > 0 for s in verifier.adapter.specs]
    assert any(windowed)
    for (k, _), w in zip(session.state.kv_caches, windowed):
        assert k.shape[0] == (2 * ring if w else 2 * 128 // PAGE)
    session.step([8, 7], accept=[8, 7])
    for _ in range(14):
        session.step([session.rng.randint(1, STEP) for _ in range(2)])
    assert min(s.numel() for s in session.seqs) > 3 * ring * PAGE
    assert session.max_err <= 1e-5, session.max_err


def test_rings_through_tier_buffers_exact_vs_hf():
    """The session path (static, padded tier buffers; padding rows write nowhere in the ring
    either) over the wrapped ring: still HF's rows."""
    model = _build("gemma2")
    verifier = dspark_compile(model)
    session = Session(model, verifier, [1, 0], max_context=128, seed=6, page_size=PAGE,
                      max_step_tokens=STEP, window_rings=True)
    session.vocab = VOCAB
    verifier.capture(session.state, block=STEP, use_graphs=False)
    session.step([8, 5], accept=[8, 5])
    for _ in range(12):
        session.step([session.rng.randint(1, STEP) for _ in range(2)])
    assert session.max_err <= 1e-5, session.max_err


def test_rows_the_window_no_longer_sees_may_hold_nan():
    """Before every step, each ring row that holds no position of the slot's current window is
    filled with NaN: the logits still equal HF's."""
    model = _build("mistral")
    verifier = dspark_compile(model)
    session = Session(model, verifier, [0, 1], max_context=128, seed=4, page_size=PAGE,
                      max_step_tokens=STEP, window_rings=True)
    session.vocab = VOCAB
    state = session.state
    page_map = state.window_maps[WINDOW]
    ring_rows = math.ceil((WINDOW + STEP - 1) / PAGE) * PAGE
    session.step([8, 6], accept=[8, 6])
    for _ in range(10):
        for slot, seq in zip(session.slots, session.seqs):
            keep = set()
            for pos in range(max(0, seq.numel() - WINDOW + 1), seq.numel()):
                page = int(page_map[state.block_table[slot, pos // PAGE].long()])
                keep.add(page * PAGE + pos % PAGE)
            first = slot * ring_rows
            for row in range(first, first + ring_rows):
                if row not in keep:
                    for k, v in state.kv_caches:
                        k.view(-1, *k.shape[2:])[row] = float("nan")
                        v.view(-1, *v.shape[2:])[row] = float("nan")
        session.step([session.rng.randint(1, STEP) for _ in range(2)])
    assert session.max_err <= 1e-5, session.max_err


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_over_a_ring_equals_full_pool_reference(num_splits):
    """The Triton kernel (the interpreter on the CPU, or a GPU) over ring pages, every row the
    window cannot see set to NaN, against the reference over a full pool holding the same
    positions; windows with sinks, contexts that have wrapped the ring several times."""
    from dspark_compile.kernels.attention import ragged_attention_triton
    from dspark_compile.ops import attention_reference as reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, pages = 4, 2, 16, 16
    contexts, lens = [37, 50, 0], [3, 8, 6]
    specs = [AttentionSpec(kv_heads, dim, window=WINDOW)]
    state = VerifierState.allocate(specs, 3, pages * PAGE, PAGE, torch.float32,
                                   torch.device("cpu"), STEP)
    page_map, table = state.window_maps[WINDOW], state.block_table
    ring_rows = state.kv_caches[0][0].shape[0] * PAGE
    full_k = torch.randn(3 * pages * PAGE, kv_heads, dim, generator=gen)
    full_v = torch.randn(3 * pages * PAGE, kv_heads, dim, generator=gen)
    ring_k = torch.full((ring_rows, kv_heads, dim), float("nan"))
    ring_v = torch.full((ring_rows, kv_heads, dim), float("nan"))
    full_slots, ring_slots = [], []
    for r, (ctx, n) in enumerate(zip(contexts, lens)):
        for pos in range(ctx + n):
            page = int(table[r, pos // PAGE])
            full_row = page * PAGE + pos % PAGE
            ring_row = int(page_map[page]) * PAGE + pos % PAGE
            if pos >= ctx:
                full_slots.append(full_row)
                ring_slots.append(ring_row)
            elif pos > ctx - WINDOW:  # the committed keys the step's window still sees
                ring_k[ring_row], ring_v[ring_row] = full_k[full_row], full_v[full_row]
    n = sum(lens)
    q = torch.randn(n, heads, dim, generator=gen)
    k, v = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim,
                                                                      generator=gen)
    sinks = torch.randn(heads, generator=gen)
    qsl = torch.tensor([0, 3, 11, 17], dtype=torch.int32)
    seq = torch.tensor([c + m for c, m in zip(contexts, lens)], dtype=torch.int32)

    def pool(x):
        return x.view(-1, PAGE, kv_heads, dim).clone()

    want = reference.ragged_attention(q, k, v, pool(full_k), pool(full_v), qsl, seq, table,
                                      torch.tensor(full_slots), 0.25, WINDOW, 0.0, sinks)
    got = ragged_attention_triton(
        *(x.to(dev) for x in (q, k, v, pool(ring_k), pool(ring_v), qsl, seq,
                              page_map[table.long()], torch.tensor(ring_slots))),
        0.25, WINDOW, 0.0, sinks.to(dev), num_splits=num_splits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, atol=3e-3 if dev == "cuda" else 1e-5,
                               rtol=3e-3 if dev == "cuda" else 1e-5)


def test_a_step_longer_than_the_rings_is_refused_before_it_runs():
    model = _build("mistral")
    verifier = dspark_compile(model)
    state = verifier.new_state(max_requests=2, max_context=128, page_size=PAGE,
                               max_step_tokens=STEP, window_rings=True)
    before = [k.clone() for k, _ in state.kv_caches]
    layout = VerifyLayout.pack([STEP + 1, 1], [0, 0], [0, 1])
    with pytest.raises(ValueError, match=r"request 0 has 9 tokens .* at most 8 "
                                         r"\(new_state's max_step_tokens\)"):
        verifier(torch.zeros(STEP + 2, dtype=torch.int64), layout, state)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, state.kv_caches))
    with pytest.raises(ValueError, match="run_dense: this state keeps some pools in rings"):
        verifier.run_dense(torch.zeros(2, 1, dtype=torch.int64), [0, 0], [0, 1], state)


def test_short_contexts_and_the_default_keep_full_pools():
    """A ring no smaller than the block table is not made, nor any without ``window_rings``:
    the pools and metadata are the full ones."""
    model = _build("mistral")
    verifier = dspark_compile(model)
    plain = verifier.new_state(max_requests=2, max_context=128, page_size=PAGE,
                               max_step_tokens=STEP)
    assert plain.window_maps == {WINDOW: None} and plain.window_step_tokens == 0
    with pytest.raises(ValueError, match="window_rings=1; it must be a bool"):
        verifier.new_state(max_requests=2, max_context=128, window_rings=1)
    state = verifier.new_state(max_requests=2, max_context=12, page_size=PAGE,
                               max_step_tokens=STEP, window_rings=True)
    assert state.window_maps == {WINDOW: None} and state.window_step_tokens == 0
    assert all(k.shape[0] == 2 * 3 for k, _ in state.kv_caches)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_triton_rings_match_hf(graphs):
    """Gemma 2 (windowed and full layers, softcap) in float32 through the Triton lowering,
    eagerly and in tier graphs, the ring wrapped several times: HF's rows."""
    model = _build("gemma2").cuda()
    verifier = dspark_compile(model, lowering="triton")
    session = Session(model, verifier, [1, 0], max_context=128, seed=3, device="cuda",
                      page_size=PAGE, max_step_tokens=STEP, window_rings=True)
    session.vocab = VOCAB
    if graphs:
        verifier.capture(session.state, block=STEP, progress=False)
    session.step([8, 7], accept=[8, 7])
    for _ in range(14):
        session.step([session.rng.randint(1, STEP) for _ in range(2)])
    assert session.max_err < 2e-2, session.max_err
