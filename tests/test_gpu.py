"""GPU tests (``pytest -m gpu`` on the accelerator machine; skipped without a GPU)."""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.session.tiers import select_tier, tier_set
from helpers import PlainDecoder, Session, tiny_llama

pytestmark = pytest.mark.gpu


def random_layout(rng, max_requests, block, context, slots_pool):
    r = rng.randint(1, max_requests)
    lens = [rng.randint(1, block) for _ in range(r)]
    slots = rng.sample(slots_pool, r)
    return VerifyLayout.pack(lens, [context[s] for s in slots], slots)


def test_hf_llama_float32_on_gpu_matches_hf():
    model = tiny_llama().cuda()
    verifier = dspark_compile(model, lowering="triton")
    session = Session(model, verifier, [3, 0, 2], seed=1, device="cuda")
    session.vocab = model.config.vocab_size
    session.step([7, 3, 12], accept=[7, 3, 12])
    rng = random.Random(0)
    for _ in range(4):
        session.step([rng.randint(1, 8) for _ in range(3)])
    assert session.max_err < 2e-3  # TF32-free fp32 attention, cuBLAS matmuls


def test_triton_verifier_equals_reference_in_bf16():
    model = tiny_llama(layers=2).cuda().to(torch.bfloat16)
    tri = dspark_compile(model, lowering="triton")
    ref = dspark_compile(model, lowering="reference")
    gen = torch.Generator().manual_seed(0)
    states = [v.new_state(max_requests=6, max_context=96) for v in (tri, ref)]
    prompts = torch.randint(0, 97, (40,), generator=gen).cuda()
    layout = VerifyLayout.pack([9, 20, 11], [0, 0, 0], [5, 1, 2])
    outs = [v(prompts, layout, s) for v, s in zip((tri, ref), states)]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=5e-2, rtol=5e-2)
    for v, s in zip((tri, ref), states):
        v.commit(layout, [9, 20, 11], s)
    ids = torch.randint(0, 97, (10,), generator=gen).cuda()
    layout = VerifyLayout.pack([3, 6, 1], [9, 20, 11], [5, 1, 2])
    outs = [v(ids, layout, s) for v, s in zip((tri, ref), states)]
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=5e-2, rtol=5e-2)


def test_down_projection_in_k_chunks_past_the_skinny_rows(monkeypatch):
    """An MLP of 256 over 64 (K = 4 N): at 33 to 384 rows the down projection runs as K-chunk
    partials (``TargetConfig.mid_split_k``). Graph replays equal eager bit for bit on those
    tiers, and the logits match the reference lowering."""
    from dspark_compile.kernels import skinny as triton_skinny

    calls = []
    partials = triton_skinny._split_partials
    monkeypatch.setattr(triton_skinny, "_split_partials",
                        lambda a, w, s: calls.append(a.shape[0]) or partials(a, w, s))
    model = tiny_llama(layers=2, intermediate=256).cuda().to(torch.bfloat16)
    tri = dspark_compile(model, lowering="triton")
    ref = dspark_compile(model, lowering="reference")
    block, max_requests = 8, 16
    tiers = [t for t in tier_set(max_requests, block) if t.tokens > 32]
    states = [tri.new_state(max_requests=max_requests, max_context=64) for _ in range(2)]
    ref_state = ref.new_state(max_requests=max_requests, max_context=64)
    tri.capture(states[0], tiers=tiers, progress=False)
    tri.capture(states[1], tiers=tiers, use_graphs=False)
    rng = random.Random(2)
    for _ in range(20):
        lens = [rng.randint(1, block) for _ in range(max_requests)]
        while sum(lens) <= 32:
            lens[rng.randrange(max_requests)] = block
        layout = VerifyLayout.pack(lens, [0] * max_requests, list(range(max_requests)))
        ids = torch.randint(0, 97, (layout.num_tokens,), device="cuda")
        a = tri(ids, layout, states[0]).clone()
        b = tri(ids, layout, states[1]).clone()
        assert torch.equal(a, b)
        want = ref(ids, layout, ref_state)
        torch.testing.assert_close(a.float(), want.float(), atol=5e-2, rtol=5e-2)
    assert calls and all(32 < m <= 384 for m in calls)


@pytest.fixture(scope="module")
def plain_gpu():
    model = PlainDecoder(seed=3).cuda()
    return model, dspark_compile(model, lowering="triton")


def test_graph_replay_equals_eager_bitwise_on_every_tier(plain_gpu):
    _, verifier = plain_gpu
    block, max_requests = 4, 8
    tiers = tier_set(max_requests, block)
    graph_state = verifier.new_state(max_requests=max_requests, max_context=64)
    eager_state = verifier.new_state(max_requests=max_requests, max_context=64)
    for st in (graph_state, eager_state):
        st.committed_lens[:] = 20
    torch.manual_seed(0)
    for (k, v), (k2, v2) in zip(graph_state.kv_caches, eager_state.kv_caches):
        k.normal_(), v.normal_()
        k2.copy_(k), v2.copy_(v)
    verifier.capture(graph_state, tiers=tiers, progress=False)
    verifier.capture(eager_state, tiers=tiers, use_graphs=False)
    seen = set()
    rng = random.Random(0)
    for _ in range(200):
        layout = random_layout(rng, max_requests, block, [20] * max_requests,
                               list(range(max_requests)))
        ids = torch.randint(0, 61, (layout.num_tokens,), device="cuda")
        a = verifier(ids, layout, graph_state).clone()
        b = verifier(ids, layout, eager_state).clone()
        assert torch.equal(a, b)
        seen.add(select_tier(tiers, layout.num_tokens, layout.num_requests))
    assert len(seen) > len(tiers) // 2


def test_thousand_random_steps_cycle_through_tiers(plain_gpu):
    model, verifier = plain_gpu
    block, max_requests = 8, 16
    state = verifier.new_state(max_requests=max_requests, max_context=2048)
    verifier.capture(state, tiers=tier_set(max_requests, block), progress=False, debug=True)
    rng = random.Random(1)
    context = [0] * max_requests
    for step in range(1000):
        layout = random_layout(rng, max_requests, block, context, list(range(max_requests)))
        ids = torch.randint(0, 61, (layout.num_tokens,), device="cuda")
        logits = verifier(ids, layout, state)
        assert logits.shape == (layout.num_tokens, 61)
        accept = [rng.randint(1, int(n)) for n in layout.lens]
        verifier.commit(layout, accept, state)
        for s, a in zip(layout.slots.tolist(), accept):
            context[s] += a
            if context[s] > 1900:
                state.release([s])
                context[s] = 0
    assert torch.isfinite(logits).all()
    torch.cuda.synchronize()


def test_capture_whole_tier_set_ten_times(plain_gpu):
    _, verifier = plain_gpu
    tiers = tier_set(256, 8)
    for _ in range(10):
        state = verifier.new_state(max_requests=256, max_context=64)
        graphs = verifier.capture(state, tiers=tiers, progress=False).graphs
        for tier in tiers:
            w = tier.tokens // tier.request_slots
            layout = VerifyLayout.pack([w] * tier.request_slots, [0] * tier.request_slots,
                                       list(range(tier.request_slots)))
            ids = torch.zeros(layout.num_tokens, dtype=torch.int64, device="cuda")
            out = verifier(ids, layout, state)
            assert torch.isfinite(out).all()
        del graphs, state
    torch.cuda.synchronize()


def _our_jit_functions():
    """Every Triton JITFunction defined in the kernel modules."""
    import sys

    from triton.runtime.jit import JITFunction

    return [v for name, mod in list(sys.modules.items())
            if name.startswith("dspark_compile.kernels.") for v in vars(mod).values()
            if isinstance(v, JITFunction)]


def test_compile_ahead_compiles_every_tier_kernel_and_touches_no_state(monkeypatch):
    """Qwen3.5-like hybrid (attention, conv, gated delta rule, commits): after the
    compile-ahead pass, the captures compile nothing; the pass wrote no KV or linear state."""
    from triton.runtime.jit import JITFunction

    from dspark_compile.kernels import launch
    from helpers import tiny_qwen35

    model = tiny_qwen35(vocab=101).cuda()
    verifier = dspark_compile(model, lowering="triton")
    state = verifier.new_state(max_requests=8, max_context=96)
    layout = VerifyLayout.pack([3, 5], [0, 0], [1, 4])
    verifier(torch.randint(0, 100, (8,), device="cuda"), layout, state)  # imports, Inductor
    for fn in _our_jit_functions():
        fn.device_caches.clear()  # as in a new process (the disk cache still answers)
    compiles = []
    inner = JITFunction._do_compile

    def counted(self, *args, **kwargs):
        compiles.append((self.fn.__name__, launch.warming()))
        return inner(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counted)
    torch.manual_seed(0)
    pools = [t for kv in state.kv_caches for t in kv] + list(state.linear.conv_states) + \
        list(state.linear.recurrent_states)
    for t in pools:
        t.normal_()
    before = [t.clone() for t in pools]
    assert verifier.capture(state, block=8, progress=False).ahead_seconds > 0
    ahead = {name for name, warm in compiles if warm}
    assert {"_metadata_kernel", "_ragged_attention_kernel", "_causal_conv1d_kernel",
            "_gdn_forward_kernel", "_gdn_commit_kernel", "_conv_commit_kernel"} <= ahead
    assert [name for name, warm in compiles if not warm] == []
    for a, b in zip(before, pools):
        assert torch.equal(a, b)


def test_hybrid_commit_graphs_match_eager_commit():
    """Qwen3.5-like hybrid on the GPU: tier graphs for the forward and one commit graph per
    request-slot count, against the same steps without graphs (slot 0 is both a real request
    and where padded requests point)."""
    from helpers import tiny_qwen35

    model = tiny_qwen35(vocab=101).cuda()
    verifier = dspark_compile(model, lowering="triton")
    states = [verifier.new_state(max_requests=8, max_context=96) for _ in range(2)]
    session = verifier.capture(states[1], block=8, progress=False)
    assert session.graphs.commit_graphs, "hybrid states capture their commit"
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    slots, ctx = [0, 3, 5], [0, 0, 0]
    prompt = [torch.randint(0, 100, (n,), generator=gen).cuda() for n in (6, 2, 9)]
    for state in states:
        layout = VerifyLayout.pack([6, 2, 9], ctx, slots)
        verifier(torch.cat(prompt), layout, state)
        verifier.commit(layout, [6, 2, 9], state)
    ctx = [6, 2, 9]
    for _ in range(20):
        lens = [rng.randint(1, 8) for _ in slots]
        accept = [rng.randint(1, n) for n in lens]
        ids = torch.randint(0, 100, (sum(lens),), generator=gen).cuda()
        layout = VerifyLayout.pack(lens, ctx, slots)
        outs = []
        for state in states:
            outs.append(verifier(ids, layout, state).clone())
            verifier.commit(layout, accept, state)
        torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
        ctx = [c + a for c, a in zip(ctx, accept)]
    for a, b in zip((*states[0].linear.conv_states, *states[0].linear.recurrent_states),
                    (*states[1].linear.conv_states, *states[1].linear.recurrent_states)):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=2e-3)


def _same_steps(verifiers, slots, prompts, seed, steps=5, tol=5e-2):
    """Prefill ``prompts`` (if any) and run ``steps`` random verify/commit steps through each
    verifier on its own state; every step's logits must agree within ``tol``."""
    states = [v.new_state(max_requests=8, max_context=96) for v in verifiers]
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    ctx = [0] * len(slots)
    for i in range(steps + (1 if prompts else 0)):
        lens = prompts if (i == 0 and prompts) else [rng.randint(1, 8) for _ in slots]
        ids = torch.randint(0, 97, (sum(lens),), generator=gen).cuda()
        layout = VerifyLayout.pack(lens, ctx, slots)
        outs = [v(ids, layout, s).float() for v, s in zip(verifiers, states)]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], atol=tol, rtol=tol)
        for v, s in zip(verifiers, states):
            v.commit(layout, lens, s)
        ctx = [c + n for c, n in zip(ctx, lens)]


def test_group_linears_verifier_matches_ungrouped_in_bf16():
    """q+k+v (and gate+up) through the grouped skinny matmul (Triton, bf16) and through one
    matmul by the stacked weights, against one torch.mm per weight, whole verifier: a prefill
    (wide, torch.mm) and verify steps of 3..40 rows (the kernel)."""
    model = tiny_llama(layers=2).cuda().to(torch.bfloat16)
    # "concat" first: it rebinds the model's q/k/v and gate/up parameters as row views of
    # stacked buffers, which a verifier built before it would refuse as moved weights
    verifiers = [dspark_compile(model, lowering="triton", group_linears=g)
                 for g in ("concat", "off", "triton")]
    rng = random.Random(2)
    _same_steps(verifiers, [1, 4, 6, 0, 2], [rng.randint(3, 20) for _ in range(5)], seed=2)


def test_fused_rotary_verifier_matches_inductor_rotary_in_bf16():
    """rotary="triton" (one Triton launch per layer for q and k) against the graph's own rotary
    under Inductor, whole verifier in bf16."""
    model = tiny_llama(layers=2).cuda().to(torch.bfloat16)
    verifiers = [dspark_compile(model, lowering="triton", inductor=True, rotary=r)
                 for r in ("inductor", "triton")]
    _same_steps(verifiers, [1, 4, 6], None, seed=3)
