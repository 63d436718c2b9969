"""Mamba-2 (SSD) on the GPU (``pytest -m gpu``; skipped without a device).

The Triton scan and commit at Nemotron-H's shapes in bf16 against the reference; tiny Mamba-2
hybrids through the Triton lowering against HF's own forward (float32); and tier-graph replays
(forward and commit graphs) against the same static buffers run eagerly, bit for bit.
"""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.ops import ssd as ssd_ops
from helpers import Session
from ssm_models import VOCAB, tiny_ssm

pytestmark = pytest.mark.gpu
OPS = torch.ops.dspark


def _case(lens, h=128, g=8, n_state=128, p=64, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, r = sum(lens), len(lens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).cuda()

    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    slots = torch.randperm(2 * r, generator=gen)[:r].to(torch.int32)
    return dict(x=rnd(n + 3, h, p), dt=rnd(n + 3, h, scale=0.5), B=rnd(n + 3, g, n_state),
                C=rnd(n + 3, g, n_state), A=-torch.rand(h, generator=gen).add(0.5).cuda(),
                D=torch.randn(h, generator=gen).cuda(),
                dt_bias=torch.randn(h, generator=gen).mul(0.3).cuda(),
                state=torch.randn(2 * r, h, n_state, p, generator=gen).mul(0.3).cuda(),
                qsl=qsl.cuda(), slots=slots.cuda())


@pytest.mark.parametrize("lens, shape", [
    ([1], {}), ([8] * 16, {}), ([3, 1, 8, 2, 5, 1, 7, 4] * 8, {}), ([40, 3], {}),
    # Falcon-Mamba-7B's Mamba-1 mixer as one-element heads: 131072 of them, heads first
    ([3, 8, 1], dict(h=8192 * 16, g=16, n_state=1, p=1))])
def test_ssd_kernel_matches_reference_at_nemotron_shapes(lens, shape):
    from dspark_compile.kernels import ssd as triton_ssd

    c = _case(lens, **shape)
    h, p = c["x"].shape[1:]
    g, n_state = c["B"].shape[1:]
    outs, rings = [], []
    for impl in (OPS.ssd, triton_ssd.ssd_triton):
        r = ssd_ops.ssd_ring(c["x"].shape[0], h, g, n_state, p, "cuda")
        outs.append(impl(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"],
                         c["state"], c["qsl"], c["slots"], *r, True, 0.0, float("inf")))
        rings.append(r)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)
    acc = torch.tensor([max(1, n // 2) for n in lens], dtype=torch.int32, device="cuda")
    pools = [c["state"].clone() for _ in range(2)]
    OPS.ssd_commit(pools[0], *rings[0], c["qsl"], c["slots"], acc)
    triton_ssd.ssd_commit_triton(pools[1], *rings[1], c["qsl"], c["slots"], acc)
    torch.testing.assert_close(pools[1], pools[0], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("family", ["nemotron_h", "bamba", "zamba2", "mamba", "jamba"])
def test_mamba_hybrid_float32_on_gpu_matches_hf(family):
    model = tiny_ssm(family).cuda()
    verifier = dspark_compile(model, lowering="triton")
    session = Session(model, verifier, [3, 0, 2], seed=1, device="cuda")
    session.vocab = VOCAB
    session.step([7, 3, 12], accept=[7, 3, 12])
    rng = random.Random(0)
    for _ in range(4):
        session.step([rng.randint(1, 8) for _ in range(3)])
    assert session.max_err < 2e-3, f"{family}: {session.max_err}"


def test_mamba_hybrid_graph_replay_equals_eager_bitwise():
    """Tier graphs of the forward and of the commit replayed against the same static buffers
    run eagerly: logits and every conv and SSM state bit for bit, over 60 random steps."""
    model = tiny_ssm("nemotron_h").cuda().to(torch.bfloat16)
    verifier = dspark_compile(model, lowering="triton")
    states = [verifier.new_state(max_requests=8, max_context=512) for _ in range(2)]
    session = verifier.capture(states[0], block=8, progress=False)
    assert session.graphs.commit_graphs, "hybrid states capture their commit"
    verifier.capture(states[1], block=8, use_graphs=False)
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    ctx = [0] * 8
    for _ in range(60):
        slots = rng.sample(range(8), rng.randint(1, 8))
        lens = [rng.randint(1, 8) for _ in slots]
        accept = [rng.randint(1, n) for n in lens]
        ids = torch.randint(0, VOCAB, (sum(lens),), generator=gen).cuda()
        layout = VerifyLayout.pack(lens, [ctx[s] for s in slots], slots)
        outs = []
        for state in states:
            outs.append(verifier(ids, layout, state).clone())
            verifier.commit(layout, accept, state)
        assert torch.equal(outs[0], outs[1])
        for s, a in zip(slots, accept):
            ctx[s] += a
    for a, b in zip((*states[0].linear.conv_states, *states[0].linear.recurrent_states),
                    (*states[1].linear.conv_states, *states[1].linear.recurrent_states)):
        assert torch.equal(a, b)



@pytest.mark.parametrize("lens", [[3, 1, 8, 2, 5, 1, 7, 4] * 4, [40, 3, 16, 17]])
def test_ssd_float32_matches_reference_closely(lens):
    """float32 at Nemotron-H's shapes, verify widths and prefill lengths, one warp a program:
    to float32 rounding of the reference."""
    from dspark_compile.kernels import ssd as triton_ssd

    c = _case(lens, dtype=torch.float32, seed=5)
    h, p = c["x"].shape[1:]
    g, n_state = c["B"].shape[1:]
    outs = []
    for impl in (OPS.ssd, triton_ssd.ssd_triton):
        r = ssd_ops.ssd_ring(c["x"].shape[0], h, g, n_state, p, "cuda")
        outs.append(impl(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"],
                         c["state"], c["qsl"], c["slots"], *r, True, 0.0, float("inf")))
    torch.testing.assert_close(outs[1], outs[0], atol=5e-5, rtol=2e-5)


@pytest.mark.parametrize("form", ["rows", "block", "block_walk", "planned_block"])
def test_ssd_contains_rejected_rows_at_nemotron_shapes(form):
    """bf16 at Nemotron-H's shapes, the row walk and the block form (``block_walk``: full-width
    requests in the block form, the others walked by the same launch under a 128-register cap;
    ``planned_block``: ``plan_ssd``'s block form):
    NaN / Inf in every rejected row of x, dt, B and C leave the accepted rows and the committed
    states bit for bit, and the block form's outputs agree with the row walk's."""
    import dataclasses

    from dspark_compile.kernels import ssd as triton_ssd

    lens = [8, 3, 5, 1, 8, 2, 7, 4] * 4
    c = _case(lens, seed=9)
    h, p = c["x"].shape[1:]
    g, n_state = c["B"].shape[1:]
    acc = [1 + (i * 5) % n for i, n in enumerate(lens)]
    dirty = dict(c)
    for name in ("x", "dt", "B", "C"):
        t = c[name].clone()
        for i, (n, a) in enumerate(zip(lens, acc)):
            s = int(c["qsl"][i])
            for j in range(a, n):
                t[s + j] = (float("nan"), float("inf"), -float("inf"))[(i + j) % 3]
        dirty[name] = t
    base = triton_ssd.plan_ssd(len(lens), h, n_state, p, torch.cuda.get_device_properties(
        0).multi_processor_count)
    plans = [dataclasses.replace(base, block_rows=0),
             dataclasses.replace(base, block_rows=8, block_from=1, block_walk_p=0,
                                 block_form_registers=0),
             dataclasses.replace(base, block_rows=8, block_from=8, block_walk_p=16,
                                 block_form_registers=128),
             triton_ssd.plan_ssd(len(lens), h, n_state, p, torch.cuda.get_device_properties(
                 0).multi_processor_count, block_form=True)]
    plan = plans[["rows", "block", "block_walk", "planned_block"].index(form)]
    outs, pools = [], []
    for case, use in ((c, plan), (dirty, plan), (c, plans[0])):
        r = ssd_ops.ssd_ring(c["x"].shape[0], h, g, n_state, p, "cuda")
        outs.append(triton_ssd.ssd_triton(case["x"], case["dt"], case["A"], case["B"], case["C"],
                                          case["D"], case["dt_bias"], case["state"], case["qsl"],
                                          case["slots"], *r, True, 0.0, float("inf"), plan=use))
        pool = c["state"].clone()
        triton_ssd.ssd_commit_triton(pool, *r, c["qsl"], c["slots"], torch.tensor(
            acc, dtype=torch.int32, device="cuda"), plan=use)
        pools.append(pool)
    for i, a in enumerate(acc):
        s = int(c["qsl"][i])
        assert torch.equal(outs[1][s:s + a], outs[0][s:s + a]), f"request {i}"
    assert torch.equal(pools[1], pools[0])
    real = sum(lens)
    torch.testing.assert_close(outs[0][:real], outs[2][:real], atol=2e-3, rtol=2e-3)
