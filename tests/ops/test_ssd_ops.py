"""Ragged Mamba-2 (SSD) scan: opcheck, HF oracle, rollback, containment, Triton.

The oracle is HF transformers' own ``mamba2_chunk_scan`` (the torch fallback every Mamba-2
family calls on a CPU), run on each request alone from ``initial_states = pool[slot]`` (HF's
``[H, P, N]`` layout, ours transposed) with ``return_final_states``. HF scans in chunks, the op
token by token: they agree to float32 rounding. The commit's state is the forward's own
arithmetic (the same replay). Triton kernels run under ``TRITON_INTERPRET=1`` on CPU
tensors at small odd shapes; ``-m gpu`` runs them at Nemotron-H-like shapes in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dspark_compile.ops import ssd as ssd_ops
from test_linear_ops import _check_containment, _poison, accepts, make_layout

hf = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 (set before import) or a GPU")
OPS = torch.ops.dspark
INF = float("inf")
TOL = dict(atol=2e-5, rtol=2e-5)


def ssd_case(layout, h=4, g=2, n_state=8, p=6, seed=0, dtype=torch.float32, device="cpu",
             bias=True, d=True):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    n = layout.num_tokens
    return dict(x=rnd(n, h, p), dt=rnd(n, h, scale=0.5), B=rnd(n, g, n_state),
                C=rnd(n, g, n_state),
                A=-torch.rand(h, generator=gen).add(0.5).to(device),
                D=rnd(h) if d else None, dt_bias=rnd(h, scale=0.3) if bias else None,
                ssm_state=(torch.randn(layout.num_slots, h, n_state, p, generator=gen) * 0.5
                           ).to(device))


def run_ssd(c, layout, impl=OPS.ssd, limits=(0.0, INF), softplus=True, ring_fill=7.0):
    n, h, p = c["x"].shape
    g, n_state = c["B"].shape[1:]
    rings = ssd_ops.ssd_ring(n, h, g, n_state, p, c["x"].device)
    for r in rings:
        r.fill_(ring_fill)
    out = impl(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["ssm_state"],
               layout.qsl, layout.slots, *rings, softplus, *limits)
    return out, rings


def hf_ssd(c, layout, i, upto=None, limits=(0.0, INF)):
    """HF's chunked scan on request i alone from pool[slot]: (out [L, H, P], final [H, N, P])."""
    rows = layout.rows(i, upto)
    h, g = c["x"].shape[1], c["B"].shape[1]
    init = c["ssm_state"][layout.slots[i]].transpose(-1, -2)[None].clone()  # [1, H, P, N]
    out, final = hf.mamba2_chunk_scan(
        c["x"][rows][None], c["dt"][rows][None], c["A"], c["B"][rows][None],
        c["C"][rows][None], chunk_size=4, D=c["D"], dt_bias=c["dt_bias"], dt_softplus=True,
        dt_limit=limits, initial_states=init, return_final_states=True)
    assert h % g == 0
    return out[0], final[0].transpose(-1, -2)


LAYOUTS = {"mixed": ([3, 0, 5, 1, 8], 2), "one": ([1], 0), "full": ([4, 4, 4], 3),
           "empty_ends": ([0, 6, 2, 0], 1), "prefill": ([13, 2], 1)}
TRITON_LAYOUTS = {**LAYOUTS, "long": ([17, 0, 35, 16], 1)}  # past the forward's 16-row chunks


def test_opcheck_all_ops():
    layout = make_layout([2, 0, 3], num_pad=1)
    c = ssd_case(layout, h=2, g=1, n_state=4, p=3)
    rings = ssd_ops.ssd_ring(layout.num_tokens, 2, 1, 4, 3, "cpu")
    args = (c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"], c["ssm_state"],
            layout.qsl, layout.slots, *rings, True, 0.0, INF)
    torch.library.opcheck(OPS.ssd.default, args)
    torch.library.opcheck(OPS.ssd_commit.default, (c["ssm_state"].clone(), *rings, layout.qsl,
                                                   layout.slots, accepts(layout)))
    dense = (c["x"][:4].view(2, 2, 2, 3), c["dt"][:4].view(2, 2, 2), c["A"],
             c["B"][:4].view(2, 2, 1, 4), c["C"][:4].view(2, 2, 1, 4), None, c["dt_bias"],
             c["ssm_state"], torch.tensor([3, 1], dtype=torch.int32), True, 0.001, INF)
    torch.library.opcheck(OPS.dense_ssd.default, dense)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("h, g, bias, d, limits", [
    (4, 2, True, True, (0.0, INF)), (3, 3, False, False, (0.001, INF)),
    (4, 1, True, False, (0.01, 0.4))])
def test_ssd_matches_hf_and_commit(name, h, g, bias, d, limits):
    lens, pad = LAYOUTS[name]
    layout = make_layout(lens, num_pad=pad, seed=h)
    c = ssd_case(layout, h=h, g=g, seed=h + g, bias=bias, d=d)
    out, rings = run_ssd(c, layout, limits=limits)
    acc, committed = accepts(layout, seed=h), c["ssm_state"].clone()
    OPS.ssd_commit(committed, *rings, layout.qsl, layout.slots, acc)
    want = c["ssm_state"].clone()
    for i, n in enumerate(lens):
        if n:
            torch.testing.assert_close(out[layout.rows(i)], hf_ssd(c, layout, i,
                                                                    limits=limits)[0], **TOL)
            a = int(acc[i])
            want[int(layout.slots[i])] = hf_ssd(c, layout, i, upto=a, limits=limits)[1]
    torch.testing.assert_close(committed, want, **TOL)
    real = sum(lens)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))


def test_commit_continues_the_forward():
    """A one-row forward from the state committed after ``len - 1`` rows gives the forward's
    last row (to rounding: CPU exp differs in its last bit between vector lanes and tails)."""
    layout = make_layout([5, 3], num_pad=0)
    c = ssd_case(layout, seed=3)
    out, rings = run_ssd(c, layout)
    committed = c["ssm_state"].clone()
    OPS.ssd_commit(committed, *rings, layout.qsl, layout.slots,
                   torch.tensor([4, 2], dtype=torch.int32))
    last = [layout.rows(0).stop - 1, layout.rows(1).stop - 1]
    one = make_layout([1, 1], num_pad=0)
    one.slots, one.num_slots = layout.slots, layout.num_slots
    c1 = {**c, "ssm_state": committed, **{k: c[k][last] for k in ("x", "dt", "B", "C")}}
    out1, _ = run_ssd(c1, one)
    torch.testing.assert_close(out1, out[last], atol=1e-6, rtol=1e-6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 6), min_size=1, max_size=5), num_pad=st.integers(0, 3),
       seed=st.integers(0, 10_000))
def test_rejected_rows_never_reach_accepted_rows_or_state(lens, num_pad, seed):
    """Random layouts: NaN/Inf in every rejected and padding row of every input changes no
    accepted output and no committed state, bit for bit."""
    layout = make_layout(lens, num_pad=num_pad, seed=seed)
    acc = accepts(layout, seed)
    c = ssd_case(layout, h=2, g=1, n_state=4, p=3, seed=seed)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("x", "dt", "B", "C")}}
    clean, dirty = run_ssd(c, layout), run_ssd(d, layout)
    _check_containment(layout, acc, clean, dirty)
    states = [c["ssm_state"].clone() for _ in range(2)]
    for st_, (_, rings) in zip(states, (clean, dirty)):
        OPS.ssd_commit(st_, *rings, layout.qsl, layout.slots, acc)
    assert torch.equal(states[0], states[1])


@pytest.mark.parametrize("lens, accept", [([], []), ([0, 0], [3, 1]), ([2, 3], [0, -1])])
def test_padding_only_and_zero_accepts_change_nothing(lens, accept):
    layout = make_layout(lens, num_pad=11)
    c = ssd_case(layout)
    out, rings = run_ssd(c, layout)
    real = sum(lens)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert all(bool((r[real:] == 7.0).all()) for r in rings)
    pool = c["ssm_state"].clone()
    OPS.ssd_commit(pool, *rings, layout.qsl, layout.slots,
                   torch.tensor(accept, dtype=torch.int32))
    assert torch.equal(pool, c["ssm_state"])


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(dt=a["dt"][:, :2]), "dt has shape"),
    (lambda a: a.update(C=a["C"][:, :1]), "B .* and C .* must both be"),
    (lambda a: a.update(A=a["A"][:3]), r"A has shape \(3,\)"),
    (lambda a: a.update(D=a["D"].double()), "D has dtype"),
    (lambda a: a.update(ssm_state=a["ssm_state"].transpose(-1, -2).contiguous()),
     "ssm_state has shape"),
    (lambda a: a.update(ring_x=a["ring_x"][:2]), "M >= N"),
    (lambda a: a.update(slots=torch.tensor([0, 9], dtype=torch.int32)), r"lie in \[0, 4\)"),
])
def test_ssd_argument_errors(change, match):
    layout = make_layout([2, 3], num_pad=0)
    c = ssd_case(layout, p=5)
    rings = ssd_ops.ssd_ring(layout.num_tokens, 4, 2, 8, 5, "cpu")
    a = dict(c, qsl=layout.qsl, slots=layout.slots, ring_x=rings[0], ring_b=rings[1],
             ring_da=rings[2], dt_softplus=True, dt_min=0.0, dt_max=INF)
    change(a)
    with pytest.raises(ValueError, match=match):
        OPS.ssd(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["ssm_state"],
                a["qsl"], a["slots"], a["ring_x"], a["ring_b"], a["ring_da"], a["dt_softplus"],
                a["dt_min"], a["dt_max"])


# ------------------------------------------------------------------ Triton (interpreter / GPU)

def _triton():
    from dspark_compile.kernels import ssd as triton_ssd

    return triton_ssd


def _check_triton(kernels, c, layout, plan, limits, seed):
    """The Triton forward under ``plan`` against the reference: outputs, zeroed padding rows,
    rings, and the committed state of random accepted lengths."""
    want, want_rings = run_ssd(c, layout, limits=limits)
    got, got_rings = run_ssd(c, layout, limits=limits, impl=lambda *a: kernels.ssd_triton(
        *a, plan=plan))
    torch.testing.assert_close(got, want, **TOL)
    real = sum(layout.lens)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    for a, b in zip(got_rings, want_rings):
        torch.testing.assert_close(a, b, **TOL)
    acc = accepts(layout, seed=seed)
    pools = [c["ssm_state"].clone() for _ in range(2)]
    OPS.ssd_commit(pools[0], *want_rings, layout.qsl, layout.slots, acc)
    kernels.ssd_commit_triton(pools[1], *got_rings, layout.qsl, layout.slots, acc, plan=plan)
    torch.testing.assert_close(pools[1], pools[0], **TOL)


@needs_triton
@pytest.mark.parametrize("name", ["mixed", "empty_ends", "prefill", "long"])
@pytest.mark.parametrize("h, g, n_state, p, bias, d, limits", [
    (4, 2, 8, 6, True, True, (0.0, INF)), (3, 1, 5, 20, False, False, (0.001, 0.5)),
    (12, 3, 1, 1, True, False, (-INF, INF))])  # Mamba-1's one-element heads (frontend/mamba)
def test_triton_matches_reference(name, h, g, n_state, p, bias, d, limits):
    """Odd shapes (N and P not powers of two, P over two channel blocks, one-element heads),
    padding rows, empty requests; outputs, rings and the committed state against the
    reference."""
    kernels = _triton()
    lens, pad = TRITON_LAYOUTS[name]
    layout = make_layout(lens, num_pad=pad, seed=p)
    c = ssd_case(layout, h=h, g=g, n_state=n_state, p=p, seed=p, bias=bias, d=d)
    plan = kernels.plan_ssd(len(lens), h, n_state, p, 132)
    if p > 16:
        plan = kernels.SsdPlan(plan.n_pad, 16, 2)
    if p == 1:  # the grid with heads on its first axis, as past 65535 (head, block) programs
        plan = kernels.SsdPlan(plan.n_pad, plan.block_p, plan.num_pb, heads_first=True)
    _check_triton(kernels, c, layout, plan, limits, seed=p)


@needs_triton
@pytest.mark.parametrize("name", ["mixed", "long", "full"])
@pytest.mark.parametrize("h, g, n_state, p, bias, d, limits, block_from, own_launch, walk_p", [
    (2, 1, 40, 33, True, True, (0.0, INF), 1, True, 0),
    (3, 1, 5, 20, False, False, (0.001, 0.5), 2, False, 0),
    (2, 2, 24, 40, True, True, (0.0, INF), 3, True, 16)])
def test_triton_block_form_matches_reference(name, h, g, n_state, p, bias, d, limits,
                                             block_from, own_launch, walk_p):
    """The block form (requests of ``block_from..8`` rows from the state before them, the state
    streamed in 16-row steps: N = 40 ends inside a step, N = 5 inside the first; P = 33 over three
    channel blocks) beside the row walk of longer and shorter requests, in a launch of its own or
    in the row walk's, or walked by the block form's launch itself ``walk_p`` channels at a time
    (no second launch): outputs, rings and the committed state against the reference."""
    import dataclasses

    kernels = _triton()
    lens, pad = TRITON_LAYOUTS[name]
    layout = make_layout(lens, num_pad=pad, seed=n_state)
    c = ssd_case(layout, h=h, g=g, n_state=n_state, p=p, seed=n_state, bias=bias, d=d)
    plan = dataclasses.replace(kernels.plan_ssd(len(lens), h, n_state, p, 132, block_form=True),
                               block_p=16, num_pb=-(-p // 16), block_rows=8, block_from=block_from,
                               block_launch=own_launch, block_walk_p=walk_p)
    _check_triton(kernels, c, layout, plan, limits, seed=p)


def test_plan_takes_the_block_form_from_8_requests_with_16_channels_a_program():
    """From 8 requests at a mean of 6 rows a request (the launch's tokens, a tier's width), with
    16 channels a program; every request of 1..8 rows in the block form, longer ones walked by
    the same launch 16 channels at a time, 128 registers."""
    from dspark_compile.kernels import ssd as kernels

    assert kernels.plan_ssd(4, 128, 128, 64, 132, num_tokens=32).block_rows == 0  # < 8 requests
    assert kernels.plan_ssd(64, 128, 128, 64, 132, num_tokens=383).block_rows == 0  # < 6 a req.
    assert kernels.plan_ssd(64, 128, 128, 64, 132).block_rows == 0  # rows unknown: the walk
    assert kernels.plan_ssd(64, 128, 128, 64, 132, block_form=False).block_rows == 0
    block = kernels.plan_ssd(64, 128, 128, 64, 132, num_tokens=512)  # Nemotron-H, bs 64, all 8
    assert (block.block_rows, block.block_from, block.block_form_p, block.block_launch,
            block.block_walk_p, block.block_form_registers) == (8, 1, 64, True, 16, 128)
    assert kernels.plan_ssd(1, 128, 128, 64, 132, block_form=True).block_form_p == 16  # bs 1
    assert kernels.plan_ssd(1, 4, 8, 16, 132, block_form=True).block_rows == 8  # tiny hybrids
    assert kernels.plan_ssd(4, 8192 * 16, 1, 1, 132, block_form=True).block_rows == 0  # Mamba-1
    assert kernels.plan_ssd(4, 4, 8, 6, 132, block_form=True).block_rows == 0


@pytest.mark.parametrize("change, match", [
    (dict(block_rows=16), r"SsdPlan.block_rows=16: must be 0 or 8"),
    (dict(block_rows=8, block_from=0), r"SsdPlan.block_from=0: must be at least 1"),
    (dict(block_rows=8, block_n=8), r"SsdPlan.block_n=8: must be a power of two of at least 16"),
    (dict(block_rows=8, block_form_p=48), r"SsdPlan.block_form_p=48: must be a power of two"),
    (dict(block_rows=8, block_launch=False, block_walk_p=0, block_p=8),
     r"SsdPlan.block_p=8: must be at least 16"),
    (dict(block_rows=8, block_walk_p=24), r"SsdPlan.block_walk_p=24: must be 0, or with"),
    (dict(block_rows=8, block_launch=False, block_walk_p=16), r"SsdPlan.block_walk_p=16"),
    (dict(block_rows=8, block_form_registers=8),
     r"SsdPlan.block_form_registers=8: must be 0 .* or at least 32")])
def test_a_bad_block_plan_is_refused_before_any_launch(change, match):
    import dataclasses

    from dspark_compile.kernels import ssd as kernels

    layout = make_layout([3, 8], num_pad=1, seed=2)
    c = ssd_case(layout, h=2, g=1, n_state=4, p=16, seed=2)
    plan = dataclasses.replace(kernels.plan_ssd(2, 2, 4, 16, 132, block_form=True), **change)
    rings = ssd_ops.ssd_ring(layout.num_tokens, 2, 1, 4, 16, "cpu")
    before = [r.clone() for r in rings]
    with pytest.raises(ValueError, match=match):
        kernels.ssd_triton(c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["dt_bias"],
                           c["ssm_state"], layout.qsl, layout.slots, *rings, True, 0.0, INF,
                           plan=plan)
    assert all(torch.equal(a, b) for a, b in zip(rings, before))


@needs_triton
@pytest.mark.parametrize("regime", ["strong", "zero"])
@pytest.mark.parametrize("form", ["rows", "block"])
def test_triton_state_scale_folds_match_reference(regime, form):
    """The kernels keep ``exp(A dt)`` in a per-program scale of the state tile and fold it into
    the tile when it leaves ``[2^-40, 2^40]``: time steps of 20-60 decay by e^-10 or more a row
    (without the fold, ``x dt / scale`` overflows within a request), and a head whose decay
    underflows to exactly 0 folds at once; outputs and the committed state must match the
    reference's direct ``S * exp(A dt)``. The block form (verify widths) meets the same decays
    as sums of ``A dt`` over windows."""
    import dataclasses

    kernels = _triton()
    lens, pad = TRITON_LAYOUTS["long" if form == "rows" else "mixed"]
    layout = make_layout(lens, num_pad=pad, seed=13)
    c = ssd_case(layout, seed=13)
    plan = dataclasses.replace(kernels.plan_ssd(len(lens), 4, 8, 6, 132), block_p=16, num_pb=1,
                               block_rows=8 if form == "block" else 0, block_from=1)
    gen = torch.Generator().manual_seed(14)
    c["dt"] = 20.0 + 40.0 * torch.rand(c["dt"].shape, generator=gen)
    if regime == "zero":
        c["A"] = torch.tensor([-1e30, -1.0, -0.5, -1e30])
    want, want_rings = run_ssd(c, layout)
    got, got_rings = run_ssd(c, layout, impl=lambda *a: kernels.ssd_triton(*a, plan=plan))
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL)
    acc = accepts(layout, seed=13)
    pools = [c["ssm_state"].clone() for _ in range(2)]
    OPS.ssd_commit(pools[0], *want_rings, layout.qsl, layout.slots, acc)
    kernels.ssd_commit_triton(pools[1], *got_rings, layout.qsl, layout.slots, acc, plan=plan)
    torch.testing.assert_close(pools[1], pools[0], **TOL)


@needs_triton
def test_plan_puts_heads_first_past_the_grid_limit():
    """Past 65535 (head, channel block) programs (Falcon-Mamba-7B's 8192 x 16 one-element
    heads) they go on the grid's first axis; Mamba-2's shapes keep requests first."""
    kernels = _triton()
    assert kernels.plan_ssd(4, 8192 * 16, 1, 1, 132).heads_first
    assert not kernels.plan_ssd(64, 128, 128, 64, 132).heads_first
    with pytest.raises(ValueError, match="the grid's second axis holds at most 65535"):
        kernels._grid(70000, 8, heads_first=True)


@needs_triton
@pytest.mark.parametrize("block_rows", [0, 8])
def test_triton_contains_rejected_rows_and_changes_nothing_without_accepts(block_rows):
    """NaN / Inf in rejected and padding rows of x, dt, B and C: accepted rows and committed
    states bit for bit, in the row walk and in the block form (whose products mix rows)."""
    import dataclasses

    kernels = _triton()
    layout = make_layout([3, 0, 5, 8], num_pad=3, seed=4)
    acc = accepts(layout, 4)
    c = ssd_case(layout, h=2, g=1, n_state=4, p=3, seed=4)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("x", "dt", "B", "C")}}
    plan = dataclasses.replace(kernels.plan_ssd(4, 2, 4, 3, 132), block_p=16, num_pb=1,
                               block_rows=block_rows, block_from=1)
    runs = [run_ssd(case, layout, impl=lambda *a: kernels.ssd_triton(*a, plan=plan))
            for case in (c, d)]
    _check_containment(layout, acc, *runs)
    pools = [c["ssm_state"].clone() for _ in range(2)]
    for pool, (_, rings) in zip(pools, runs):
        kernels.ssd_commit_triton(pool, *rings, layout.qsl, layout.slots, acc, plan=plan)
    assert torch.equal(pools[0], pools[1])
    pool = c["ssm_state"].clone()
    none = torch.zeros_like(acc)
    kernels.ssd_commit_triton(pool, *runs[0][1], layout.qsl, layout.slots, none, plan=plan)
    assert torch.equal(pool, c["ssm_state"])
