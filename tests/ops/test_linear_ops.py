"""Ragged causal conv1d and gated delta rule: opcheck, HF oracle, rollback, containment, Triton.

The oracle is HF transformers' own Qwen3-Next functions, run on each request alone:
``causal_conv1d_fn`` over ``cat(conv_state, x_i)`` (bitwise), ``causal_conv1d_update`` for the
committed window, ``torch_recurrent_gated_delta_rule`` (and the chunked rule HF's verify step
runs) from ``initial_state = pool[slot]``. Triton kernels run under ``TRITON_INTERPRET=1`` on
CPU tensors at small odd shapes; ``-m gpu`` runs them at Qwen3-Next shapes in bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dspark_compile.ops import linear_attention as linear_ops
from dspark_compile.ops import linear_attention_reference as ref

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                  reason="needs TRITON_INTERPRET=1 (set before import) or a GPU")
OPS = torch.ops.dspark
NAN, INF = float("nan"), float("inf")


@dataclass
class Layout:
    """A packed layout: request i owns rows qsl[i]:qsl[i+1]; rows past qsl[R] are padding."""

    lens: list[int]
    qsl: torch.Tensor
    slots: torch.Tensor
    num_tokens: int
    num_slots: int

    def rows(self, i: int, upto: int | None = None) -> slice:
        s = int(self.qsl[i])
        return slice(s, s + (self.lens[i] if upto is None else upto))


def make_layout(lens, num_pad=2, extra_slots=2, seed=0, device="cpu") -> Layout:
    """Distinct random slots; empty requests (padding slots) get slot -1: never read."""
    g = torch.Generator().manual_seed(seed)
    num_slots = len(lens) + extra_slots
    slots = torch.randperm(num_slots, generator=g)[: len(lens)]
    slots = torch.where(torch.tensor(lens, dtype=torch.long) > 0, slots, -1)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return Layout(list(lens), qsl.to(device), slots.to(torch.int32).to(device),
                  sum(lens) + num_pad, num_slots)


def accepts(layout: Layout, seed=0) -> torch.Tensor:
    """A random accepted length in 1..len per request (0 for empty requests)."""
    g = torch.Generator().manual_seed(seed + 100)
    return torch.tensor([int(torch.randint(1, n + 1, (1,), generator=g)) if n else 0
                         for n in layout.lens], dtype=torch.int32, device=layout.qsl.device)


def conv_case(layout, dim=37, width=4, bias=True, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return dict(x=rnd(layout.num_tokens, dim), weight=rnd(dim, width),
                bias=rnd(dim) if bias else None,
                conv_state=rnd(layout.num_slots, dim, width - 1))


def gdn_case(layout, hk=2, hv=4, kd=16, vd=32, seed=0, dtype=torch.float32, device="cpu",
             channel_gates=False):
    g = torch.Generator().manual_seed(seed)
    n = layout.num_tokens

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    return dict(q=rnd(n, hk, kd).to(dtype).to(device), k=rnd(n, hk, kd).to(dtype).to(device),
                v=rnd(n, hv, vd).to(dtype).to(device),
                g=(-torch.nn.functional.softplus(  # log decay <= 0, a head's or a channel's
                    rnd(n, hv, kd) if channel_gates else rnd(n, hv))).to(device),
                beta=torch.sigmoid(rnd(n, hv)).to(dtype).to(device),
                recurrent_state=(0.3 * rnd(layout.num_slots, hv, kd, vd)).to(device))


def run_conv(c, layout, activation="silu", impl=OPS.causal_conv1d, ring_fill=7.0):
    ring = torch.full_like(c["x"], ring_fill)  # a sentinel: padding rows must not be written
    out = impl(c["x"], c["weight"], c["bias"], c["conv_state"], layout.qsl, layout.slots, ring,
               activation)
    return out, ring


def run_gdn(c, layout, l2=True, impl=OPS.gated_delta_rule, **kw):
    n, hk, kd = c["k"].shape
    hv, vd = c["v"].shape[1:]
    rings = linear_ops.gdn_ring(n, hk, hv, kd, vd, c["q"].device,
                                channel_gates=c["g"].dim() == 3)
    for r in rings:
        r.fill_(7.0)
    out = impl(c["q"], c["k"], c["v"], c["g"], c["beta"], c["recurrent_state"], layout.qsl,
               layout.slots, *rings, kd ** -0.5, l2, **kw)
    return out, rings


def hf_conv(c, layout, i, activation="silu", upto=None):
    """HF's zero-padded dense call over cat(conv_state[slot], x_i): ``[L, dim]``."""
    width = c["weight"].shape[1]
    seq = torch.cat([c["conv_state"][layout.slots[i]], c["x"][layout.rows(i, upto)].T], -1)
    act = None if activation == "none" else activation
    return hf.causal_conv1d_fn(seq[None], c["weight"], c["bias"], activation=act)[0, :,
                                                                                 width - 1:].T


def hf_gdn(c, layout, i, upto=None, l2=True, chunk=False):
    """HF's rule on request i alone from pool[slot]: (out [L, Hv, V], final state)."""
    rows = layout.rows(i, upto)
    fn = hf.torch_chunk_gated_delta_rule if chunk else hf.torch_recurrent_gated_delta_rule
    out, state = fn(*(c[n][rows][None] for n in ("q", "k", "v", "g", "beta")),
                    initial_state=c["recurrent_state"][layout.slots[i]][None].clone(),
                    output_final_state=True, use_qk_l2norm_in_kernel=l2)
    return out[0], state[0]


LAYOUTS = {"mixed": ([3, 0, 5, 1, 8], 2), "one": ([1], 0), "full": ([4, 4, 4], 3),
           "empty_ends": ([0, 6, 2, 0], 1)}
TRITON_LAYOUTS = {**LAYOUTS, "long": ([17, 0, 33, 16], 1)}  # past the forward's 16-row chunks


# ------------------------------------------------------------------ opcheck

def test_opcheck_all_ops():
    layout = make_layout([2, 0, 3], num_pad=1)
    c = conv_case(layout, dim=6)
    ring = torch.zeros_like(c["x"])
    torch.library.opcheck(OPS.causal_conv1d.default, (c["x"], c["weight"], c["bias"],
                          c["conv_state"], layout.qsl, layout.slots, ring, "silu"))
    torch.library.opcheck(OPS.causal_conv1d_commit.default, (c["conv_state"], ring, layout.qsl,
                          layout.slots, accepts(layout)))
    d = gdn_case(layout, kd=8, vd=4)
    rings = linear_ops.gdn_ring(layout.num_tokens, 2, 4, 8, 4, "cpu")
    torch.library.opcheck(OPS.gated_delta_rule.default, (
        d["q"], d["k"], d["v"], d["g"], d["beta"], d["recurrent_state"], layout.qsl,
        layout.slots, *rings, 8 ** -0.5, True))
    torch.library.opcheck(OPS.gated_delta_rule_commit.default, (
        d["recurrent_state"], *rings, layout.qsl, layout.slots, accepts(layout)))


# ------------------------------------------------------------------ reference vs HF

@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("width, activation, bias", [(4, "silu", True), (3, "none", False),
                                                     (2, "silu", False), (4, "gelu", True),
                                                     (3, "gelu_pytorch_tanh", False)])
def test_conv_bitwise_hf_and_commit(name, width, activation, bias):
    layout = make_layout(*LAYOUTS[name], seed=width)
    c = conv_case(layout, width=width, bias=bias, seed=width)
    out, ring = run_conv(c, layout, activation)
    real = sum(layout.lens)
    dense = torch.full((len(layout.lens), c["x"].shape[1], max(layout.lens)), NAN)
    for i, n in enumerate(layout.lens):
        dense[i, :, :n] = c["x"][layout.rows(i)].T
    states = c["conv_state"][layout.slots.long().clamp(min=0)]
    dense_out = hf.causal_conv1d_fn(torch.cat([states, dense], -1), c["weight"], c["bias"],
                                    activation=None if activation == "none" else activation)
    for i, n in enumerate(layout.lens):
        if n:  # the per-request call and the NaN-padded dense batch, bit for bit
            assert torch.equal(out[layout.rows(i)], hf_conv(c, layout, i, activation))
            assert torch.equal(out[layout.rows(i)], dense_out[i, :, width - 1:width - 1 + n].T)
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "padding rows must be zeros"
    assert torch.equal(ring[:real], c["x"][:real]) and bool((ring[real:] == 7.0).all())
    acc, committed = accepts(layout, seed=width), c["conv_state"].clone()
    OPS.causal_conv1d_commit(committed, ring, layout.qsl, layout.slots, acc)
    want = c["conv_state"].clone()
    for i, a in enumerate(acc.tolist()):
        if a:  # HF's in-place decode update over exactly the accepted tokens
            hf.causal_conv1d_update(c["x"][layout.rows(i, a)].T[None],
                                    want[int(layout.slots[i])][None], c["weight"], c["bias"])
    assert torch.equal(committed, want)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("hk, hv, kd, vd, l2", [(2, 4, 16, 32, True), (3, 3, 24, 20, False)])
def test_gdn_matches_hf_and_commit(name, hk, hv, kd, vd, l2):
    layout = make_layout(*LAYOUTS[name], seed=hv)
    c = gdn_case(layout, hk, hv, kd, vd, seed=hv)
    out, rings = run_gdn(c, layout, l2)
    real = sum(layout.lens)
    for i, n in enumerate(layout.lens):
        if n:
            torch.testing.assert_close(out[layout.rows(i)], hf_gdn(c, layout, i, l2=l2)[0],
                                       atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(out[layout.rows(i)],
                                       hf_gdn(c, layout, i, l2=l2, chunk=True)[0],
                                       atol=2e-5, rtol=1e-4)
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "padding rows must be zeros"
    assert all(bool((r[real:] == 7.0).all()) for r in rings), "padding rows wrote the ring"
    acc, committed = accepts(layout, seed=hv), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit(committed, *rings, layout.qsl, layout.slots, acc)
    want = c["recurrent_state"].clone()
    for i, a in enumerate(acc.tolist()):
        if a:  # the state after exactly a tokens; its op order is HF's, so bit for bit
            want[int(layout.slots[i])] = hf_gdn(c, layout, i, upto=a, l2=l2)[1]
    assert torch.equal(committed, want)


def _poison(t: torch.Tensor, layout: Layout, acc: torch.Tensor, values=(NAN, INF, -INF)):
    """NaN/Inf in every rejected row (j >= accepted) and every padding row of ``t``."""
    t = t.clone()
    for i, a in enumerate(acc.tolist()):
        s = int(layout.qsl[i])
        for j in range(a, layout.lens[i]):
            t[s + j] = values[(i + j) % len(values)]
    t[sum(layout.lens):] = NAN
    return t


def _check_containment(layout, acc, clean, dirty):
    """Accepted rows bit-identical to the clean run; padding rows zeros."""
    out_c, out_d = clean[0], dirty[0]
    for i, a in enumerate(acc.tolist()):
        assert torch.equal(out_d[layout.rows(i, a)], out_c[layout.rows(i, a)]), f"request {i}"
    real = sum(layout.lens)
    assert torch.equal(out_d[real:], torch.zeros_like(out_d[real:]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 6), min_size=1, max_size=5), num_pad=st.integers(0, 3),
       seed=st.integers(0, 10_000))
def test_rejected_rows_never_reach_accepted_rows_or_state(lens, num_pad, seed):
    """Random layouts: poisoning rejected and padding rows changes no accepted output and no
    committed conv/recurrent state, bit for bit."""
    layout = make_layout(lens, num_pad=num_pad, seed=seed)
    acc = accepts(layout, seed)
    c = conv_case(layout, dim=9, seed=seed)
    d = {**c, "x": _poison(c["x"], layout, acc)}
    clean, dirty = run_conv(c, layout), run_conv(d, layout)
    _check_containment(layout, acc, clean, dirty)
    states = [c["conv_state"].clone() for _ in range(2)]
    for st_, (_, ring) in zip(states, (clean, dirty)):
        OPS.causal_conv1d_commit(st_, ring, layout.qsl, layout.slots, acc)
    assert torch.equal(states[0], states[1])
    c = gdn_case(layout, 1, 2, 8, 8, seed=seed)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("q", "k", "v", "g", "beta")}}
    clean, dirty = run_gdn(c, layout), run_gdn(d, layout)
    _check_containment(layout, acc, clean, dirty)
    states = [c["recurrent_state"].clone() for _ in range(2)]
    for st_, (_, rings) in zip(states, (clean, dirty)):
        OPS.gated_delta_rule_commit(st_, *rings, layout.qsl, layout.slots, acc)
    assert torch.equal(states[0], states[1])


def _impls(triton: bool) -> tuple:
    """(conv, conv commit, gdn, gdn commit): the reference ops or the Triton host wrappers."""
    if not triton:
        return (OPS.causal_conv1d, OPS.causal_conv1d_commit, OPS.gated_delta_rule,
                OPS.gated_delta_rule_commit)
    from dspark_compile.kernels import conv as triton_conv
    from dspark_compile.kernels import gdn as triton_gdn

    return (triton_conv.causal_conv1d_triton, triton_conv.causal_conv1d_commit_triton,
            triton_gdn.gated_delta_rule_triton, triton_gdn.gated_delta_rule_commit_triton)


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=needs_triton)])
@pytest.mark.parametrize("lens, accept", [([], []), ([0, 0], [3, 1]), ([2, 3], [0, -1])])
def test_padding_only_and_zero_accepts_change_nothing(lens, accept, triton):
    """No request (R = 0), only empty ones, or nothing accepted: outputs of padding rows are
    zeros, the rings keep their sentinel there, and the commits leave the pools as they were."""
    layout = make_layout(lens, num_pad=11)
    conv, conv_commit, gdn, gdn_commit = _impls(triton)
    c, d = conv_case(layout, dim=20), gdn_case(layout, 1, 2, 16, 16)
    (out, ring), (out2, rings) = run_conv(c, layout, impl=conv), run_gdn(d, layout, impl=gdn)
    real = sum(lens)
    for o in (out, out2):
        assert torch.equal(o[real:], torch.zeros_like(o[real:]))
    assert all(bool((r[real:] == 7.0).all()) for r in (ring, *rings))
    acc = torch.tensor(accept, dtype=torch.int32)
    pools = c["conv_state"].clone(), d["recurrent_state"].clone()
    conv_commit(pools[0], ring, layout.qsl, layout.slots, acc)
    gdn_commit(pools[1], *rings, layout.qsl, layout.slots, acc)
    assert torch.equal(pools[0], c["conv_state"])
    assert torch.equal(pools[1], d["recurrent_state"])


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(activation="gelu_new"), "activation='gelu_new'"),
    (lambda a: a.update(weight=a["weight"][:, :3]), "conv_state has shape"),
    (lambda a: a.update(qsl=torch.tensor([1, 3, 5], dtype=torch.int32)), "must start at 0"),
    (lambda a: a.update(qsl=torch.tensor([0, 4, 3], dtype=torch.int32)), "non-decreasing"),
    (lambda a: a.update(slots=torch.tensor([0, 9], dtype=torch.int32)), r"lie in \[0, 4\)"),
    (lambda a: a.update(ring=a["ring"][:2]), "M >= N"),
    (lambda a: a.update(slots=a["slots"].float()), "slots has dtype"),
])
def test_conv_argument_errors(change, match):
    layout = make_layout([2, 3], num_pad=0)
    c = conv_case(layout)
    a = dict(x=c["x"], weight=c["weight"], bias=c["bias"], conv_state=c["conv_state"],
             qsl=layout.qsl, slots=layout.slots, ring=torch.zeros_like(c["x"]),
             activation="silu")
    change(a)
    with pytest.raises(ValueError, match=match):
        ref.causal_conv1d(*a.values())


def test_gdn_and_commit_argument_errors():
    layout = make_layout([2, 3], num_pad=0)
    d = gdn_case(layout, hk=3, hv=4)
    rings = linear_ops.gdn_ring(layout.num_tokens, 3, 4, 16, 32, "cpu")
    args = [d["q"], d["k"], d["v"], d["g"], d["beta"], d["recurrent_state"], layout.qsl,
            layout.slots, *rings, 0.25, True]
    with pytest.raises(ValueError, match="multiple of Hk=3"):
        ref.gated_delta_rule(*args)
    d = gdn_case(layout)
    rings = linear_ops.gdn_ring(layout.num_tokens, 2, 4, 16, 32, "cpu")
    with pytest.raises(ValueError, match="q has dtype torch.float32 and k torch.bfloat16; they "
                                         "must share one"):
        ref.gated_delta_rule(d["q"], d["k"].bfloat16(), d["v"], d["g"], d["beta"],
                             d["recurrent_state"], layout.qsl, layout.slots, *rings, 0.25, True)
    with pytest.raises(ValueError, match="ring_v has shape"):
        ref.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], d["recurrent_state"],
                             layout.qsl, layout.slots, rings[0], rings[0], *rings[2:], 0.25,
                             True)
    dup = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="be distinct"):
        ref.gated_delta_rule_commit(d["recurrent_state"], *rings, layout.qsl, dup,
                                    torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="accept_lens has shape"):
        ref.causal_conv1d_commit(torch.zeros(4, 3, 3), torch.zeros(5, 3), layout.qsl,
                                 layout.slots, torch.ones(3, dtype=torch.int32))


# ------------------------------------------------------------------ Triton vs reference

def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a row-strided view (a slice of a wider buffer, like a fused qkv)."""
    wide = torch.full((t.shape[0], 2 * t[0].numel() + 3), NAN, dtype=t.dtype, device=t.device)
    wide[:, 3:3 + t[0].numel()] = t.reshape(t.shape[0], -1)
    return wide[:, 3:3 + t[0].numel()].view(t.shape)


PREFILL = ([19, 2, 0, 11], 10)  # several chunks per request, padding over two chunks


@needs_triton
@pytest.mark.parametrize("name, dim, width, activation, bias, tiles", [
    ("mixed", 37, 4, "silu", True, None), ("empty_ends", 130, 3, "none", False, None),
    ("full", 64, 2, "silu", True, None), ("prefill", 45, 4, "silu", True, None),
    ("prefill", 45, 3, "none", True, (4, 16, 16, 2)), ("mixed", 37, 4, "gelu", True, None),
    ("prefill", 45, 3, "gelu_pytorch_tanh", False, (4, 16, 16, 2))])
def test_triton_conv_matches_reference(name, dim, width, activation, bias, tiles):
    """Default tiles, and 4-row chunks (windows that start in the previous chunk's rows)."""
    from dspark_compile.kernels.conv import (ConvPlan, causal_conv1d_commit_triton,
                                                     causal_conv1d_triton)

    layout = make_layout(*(PREFILL if name == "prefill" else LAYOUTS[name]), seed=dim)
    plan = ConvPlan(*tiles) if tiles else None
    c = conv_case(layout, dim=dim, width=width, bias=bias, seed=dim)
    want, want_ring = run_conv(c, layout, activation)
    # strided x and a [S, W-1, dim]-major pool seen through a transposed view
    pool = c["conv_state"].transpose(1, 2).contiguous().transpose(1, 2)
    t = {**c, "x": _strided(c["x"]), "conv_state": pool}
    got, ring = run_conv(t, layout, activation, impl=functools.partial(causal_conv1d_triton,
                                                                        plan=plan))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    real = sum(layout.lens)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    assert torch.equal(ring, want_ring)
    acc = accepts(layout, seed=dim)
    want_state = c["conv_state"].clone()
    OPS.causal_conv1d_commit(want_state, want_ring, layout.qsl, layout.slots, acc)
    causal_conv1d_commit_triton(pool, ring, layout.qsl, layout.slots, acc, plan=plan)
    assert torch.equal(pool, want_state)


def _gdn_plan(layout: Layout, hv: int, kd: int, vd: int, form: str, **fields):
    """The Triton GDN plan of a form: ``rows`` (every request walks its rows) or ``block`` (up
    to 8 rows at once, longer requests walking beside it), with changes."""
    from dspark_compile.kernels.gdn import plan_gdn

    plan = plan_gdn(len(layout.lens), hv, kd, vd, 132, block_form=form == "block")
    assert bool(plan.block_rows) == (form == "block")
    return dataclasses.replace(plan, **fields)


@needs_triton
@pytest.mark.parametrize("name, hk, hv, kd, vd, l2, fields", [
    ("mixed", 2, 4, 16, 32, True, {}), ("empty_ends", 3, 3, 24, 20, False, {}),
    ("mixed", 1, 3, 16, 24, True, {}), ("full", 1, 4, 16, 16, False, {}),
    ("full", 1, 2, 32, 48, True, {"block_v": 16, "num_vb": 3, "block_form_v": 32}),
    ("long", 2, 2, 16, 16, True, {}),
    ("long", 1, 2, 16, 48, False, {"block_form_v": 32, "block_form_warps": 2}),
    (PREFILL, 2, 4, 20, 40, True, {"block_form_v": 64})])
@pytest.mark.parametrize("form", ["rows", "block"])
def test_triton_gdn_matches_reference(name, hk, hv, kd, vd, l2, fields, form):
    """Both forms against the reference: outputs, rings (padding rows untouched) and the
    committed state; odd K and V, 1 to 4 value heads a key head (3: the block form's weight
    programs pad them to 4), channel blocks past V, long requests (they walk inside the
    block form's launch, ``walk_v`` channels at a time), strided inputs."""
    from dspark_compile.kernels.gdn import gated_delta_rule_commit_triton, gated_delta_rule_triton

    layout = make_layout(*(TRITON_LAYOUTS[name] if isinstance(name, str) else name), seed=kd)
    c = gdn_case(layout, hk, hv, kd, vd, seed=kd)
    want, want_rings = run_gdn(c, layout, l2)
    plan = _gdn_plan(layout, hv, kd, vd, form,
                     **{k: v for k, v in fields.items() if form == "block" or "form" not in k})
    t = {**c, **{n: _strided(c[n]) for n in ("q", "k", "v", "g", "beta")}}
    got, rings = run_gdn(t, layout, l2, impl=gated_delta_rule_triton, plan=plan)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    real = sum(layout.lens)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    for r, w in zip(rings, want_rings):
        torch.testing.assert_close(r, w, atol=1e-6, rtol=1e-6)
        assert bool((r[real:] == 7.0).all()), "padding rows wrote the ring"
    acc = accepts(layout, seed=kd)
    want_state, state = c["recurrent_state"].clone(), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit(want_state, *want_rings, layout.qsl, layout.slots, acc)
    gated_delta_rule_commit_triton(state, *rings, layout.qsl, layout.slots, acc, plan=plan)
    torch.testing.assert_close(state, want_state, atol=2e-6, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype, how", [(torch.bfloat16, ""), (torch.bfloat16, "bf16x3"),
                                        (torch.bfloat16, "tf32x2"), (torch.float16, "tf32x2"),
                                        (torch.bfloat16, "ieee")])
def test_triton_gdn_block_stream_dots_match_reference(dtype, how):
    """16-bit inputs through the block form's stream products, each way (:func:`_stream_dot`,
    the default for bfloat16 included, 32 state rows a step): outputs as the reference's to
    well under the inputs' rounding, long requests walking beside them."""
    from dspark_compile.kernels.gdn import gated_delta_rule_triton

    layout = make_layout([8, 3, 0, 11, 5], num_pad=2, seed=3)
    c = gdn_case(layout, 2, 4, 40, 32, seed=3, dtype=dtype)
    want, _ = run_gdn(c, layout)
    plan = _gdn_plan(layout, 4, 40, 32, "block", block_stream_dot=how, block_stream_kc=32)
    got, _ = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    # against the float32 FMAs on the same inputs: the parts' sum is the state to 2^-20
    ieee, _ = run_gdn(c, layout, impl=gated_delta_rule_triton,
                      plan=dataclasses.replace(plan, block_stream_dot="ieee"))
    assert (got.float() - ieee.float()).abs().max() <= 2 * (ieee.float().abs().max() * 2 ** -8)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_gdn_block_native_gram_matches_and_contains(dtype):
    """16-bit rows through the weight programs' one-product Gram (the default for them): the
    outputs and rings of the float32 chunks' to float32 rounding, the ring keys taken from the
    same rows; NaN / Inf in rejected and padding rows leave accepted rows bit for bit; a stream
    program making its own weights gets the weight program's bits."""
    from dspark_compile.kernels.gdn import gated_delta_rule_triton

    layout = make_layout([8, 3, 0, 11, 5, 8], num_pad=2, seed=6)
    acc = accepts(layout, 6)
    c = gdn_case(layout, 2, 4, 40, 32, seed=6, dtype=dtype)
    plan = _gdn_plan(layout, 4, 40, 32, "block", block_stream_dot="ieee")
    assert plan.block_gram == ""  # the default: native for 16-bit rows
    got, rings = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    chunks, chunk_rings = run_gdn(c, layout, impl=gated_delta_rule_triton,
                                  plan=dataclasses.replace(plan, block_gram="ieee"))
    torch.testing.assert_close(got.float(), chunks.float(), atol=0, rtol=2 ** -7)
    for r, w in zip(rings, chunk_rings):
        torch.testing.assert_close(r, w, atol=1e-6, rtol=1e-6)
    want, want_rings = run_gdn(c, layout)
    torch.testing.assert_close(rings[0], want_rings[0], atol=1e-6, rtol=1e-6)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("q", "k", "v", "g", "beta")}}
    dirty = run_gdn(d, layout, impl=gated_delta_rule_triton, plan=plan)
    _check_containment(layout, acc, (got, rings), dirty)
    own = run_gdn(d, layout, impl=gated_delta_rule_triton,
                  plan=dataclasses.replace(plan, block_weights_first=False, block_wait_polls=0))
    assert torch.equal(own[0].nan_to_num(), dirty[0].nan_to_num())


def test_gdn_block_gram_rule():
    """The Gram's way by default and the plans refused, before any launch: by name, with the
    value and the rule."""
    from dspark_compile.kernels.gdn import _gram_for, plan_gdn

    plan = plan_gdn(64, 32, 128, 128, 132, block_form=True)
    assert _gram_for(plan, torch.bfloat16) and _gram_for(plan, torch.float16)
    assert not _gram_for(plan, torch.float32)
    assert not _gram_for(dataclasses.replace(plan, block_gram="ieee"), torch.bfloat16)
    for how, dtype, match in [("native", torch.float32, "native only with 16-bit q and k"),
                              ("tf32", torch.bfloat16, "one of")]:
        with pytest.raises(ValueError, match=f"GdnPlan.block_gram='{how}': must be {match}"):
            _gram_for(dataclasses.replace(plan, block_gram=how), dtype)


@needs_triton
def test_triton_gdn_block_state_tma_matches_pointer_loads():
    """The stream programs' state chunks through a tensor descriptor: the same bits as pointer
    loads, K and V not multiples of the chunk, a slot past the pool reading zeros either way."""
    from dspark_compile.kernels.gdn import gated_delta_rule_triton

    layout = make_layout([8, 3, 0, 7, 5], num_pad=2, seed=5)
    c = gdn_case(layout, 2, 4, 40, 36, seed=5)
    slots = layout.slots.clone()
    slots[3] = c["recurrent_state"].shape[0]  # a bad slot: zeros, not another request's state
    bad = dataclasses.replace(layout, slots=slots)
    plan = _gdn_plan(layout, 4, 40, 36, "block", block_form_v=32)
    assert plan.block_state_tma  # the default
    for lay in (bad, layout):
        ptr, ptr_rings = run_gdn(c, lay, impl=gated_delta_rule_triton,
                                 plan=dataclasses.replace(plan, block_state_tma=False))
        tma, tma_rings = run_gdn(c, lay, impl=gated_delta_rule_triton, plan=plan)
        assert torch.equal(ptr, tma)
        assert all(torch.equal(a, b) for a, b in zip(ptr_rings, tma_rings))
    torch.testing.assert_close(tma, run_gdn(c, layout)[0], atol=2e-6, rtol=1e-5)


def test_gdn_block_state_tma_rule():
    """The state goes through a descriptor only where the plan asks, the target has TMA and
    the pool allows one (16-byte aligned, every stride but the last a multiple of 16 bytes)."""
    from dspark_compile.kernels.gdn import _state_tma, plan_gdn
    from dspark_compile.kernels.targets import TARGETS

    plan = plan_gdn(8, 4, 16, 36, 132, block_form=True)
    sm90, sm80 = TARGETS["sm_90"], TARGETS["sm_80"]
    pool = torch.zeros(3, 4, 16, 36)
    assert _state_tma(plan, pool, sm90)
    assert not _state_tma(plan, pool, sm80)  # no TMA there
    # the target's capability, not the experts kernels' own TMA choice
    assert _state_tma(plan, pool, dataclasses.replace(sm90, experts_tma=False))
    assert not _state_tma(plan, pool, TARGETS["gfx942"])
    assert not _state_tma(dataclasses.replace(plan, block_state_tma=False), pool, sm90)
    assert not _state_tma(plan, torch.zeros(3, 4, 16, 18), sm90)  # 72-byte rows
    assert not _state_tma(plan, torch.zeros(3 * 4 * 16 * 36 + 1)[1:].view(3, 4, 16, 36), sm90)
    assert not _state_tma(plan, torch.zeros(3, 4, 36, 16).transpose(2, 3), sm90)


def test_gdn_block_stream_dot_rule():
    """The stream products by default and the plans refused, before any launch: by name, with
    the value and the rule."""
    from dspark_compile.kernels.gdn import _stream_dot_for, plan_gdn

    plan = plan_gdn(64, 32, 128, 128, 132, block_form=True)
    assert _stream_dot_for(plan, torch.bfloat16, "cuda") == "tf32x2"
    assert _stream_dot_for(plan, torch.bfloat16, "hip") == "ieee"
    assert _stream_dot_for(dataclasses.replace(plan, block_stream_dot="bf16x3"),
                           torch.bfloat16, "hip") == "bf16x3"
    assert _stream_dot_for(plan, torch.float16, "cuda") == "tf32x2"
    assert _stream_dot_for(plan, torch.float16, "hip") == "ieee"
    assert _stream_dot_for(plan, torch.float32, "cuda") == "ieee"
    for how, dtype, backend, match in [
            ("bf16x3", torch.float16, "cuda", "bf16x3 only with bfloat16 q and k"),
            ("tf32x2", torch.float32, "cuda", "tf32x2 only with 16-bit q and k"),
            ("tf32x3", torch.float32, "hip", "tf32x3 only on NVIDIA targets"),
            ("fp8", torch.bfloat16, "cuda", "one of")]:
        with pytest.raises(ValueError, match=f"GdnPlan.block_stream_dot='{how}': must be "
                                             f"{match}"):
            _stream_dot_for(dataclasses.replace(plan, block_stream_dot=how), dtype, backend)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 10), min_size=1, max_size=5), num_pad=st.integers(0, 3),
       seed=st.integers(0, 10_000), values=st.sampled_from([(NAN,), (INF,), (-INF,),
                                                            (NAN, INF, -INF)]))
def test_triton_gdn_block_form_contains_and_matches(lens, num_pad, seed, values):
    """Random layouts through the block form (requests of 9-10 rows walk beside it): outputs
    match the reference; NaN / Inf in any input of rejected and padding rows leaves accepted
    rows, the committed state and the other rows' rings bit for bit; the rows from a block
    request's first poisoned one on come out NaN."""
    from dspark_compile.kernels.gdn import gated_delta_rule_commit_triton, gated_delta_rule_triton

    layout = make_layout(lens, num_pad=num_pad, seed=seed)
    acc = accepts(layout, seed)
    c = gdn_case(layout, 1, 2, 16, 16, seed=seed)
    plan = _gdn_plan(layout, 2, 16, 16, "block")
    d = {**c, **{n: _poison(c[n], layout, acc, values) for n in ("q", "k", "v", "g", "beta")}}
    clean = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    dirty = run_gdn(d, layout, impl=gated_delta_rule_triton, plan=plan)
    torch.testing.assert_close(clean[0], run_gdn(c, layout)[0], atol=2e-6, rtol=1e-5)
    _check_containment(layout, acc, clean, dirty)
    # the weight programs last: every stream program makes its own weights, the same bits
    last = run_gdn(d, layout, impl=gated_delta_rule_triton,
                   plan=dataclasses.replace(plan, block_weights_first=False,
                                            block_wait_polls=0))
    assert torch.equal(last[0].nan_to_num(), dirty[0].nan_to_num())
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(last[1], dirty[1]))
    # weights last with polling: a stream program reads an unset flag to its bound, then
    # makes its own (the interpreter runs the programs one after another)
    polled = run_gdn(d, layout, impl=gated_delta_rule_triton,
                     plan=dataclasses.replace(plan, block_weights_first=False,
                                              block_wait_polls=3))
    assert torch.equal(polled[0].nan_to_num(), dirty[0].nan_to_num())
    # the weight programs in a launch of their own: the same bits, outputs and rings
    split = run_gdn(d, layout, impl=gated_delta_rule_triton,
                    plan=dataclasses.replace(plan, block_weights_launch=True))
    assert torch.equal(split[0].nan_to_num(), dirty[0].nan_to_num())
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(split[1], dirty[1]))
    for i, (n, a) in enumerate(zip(layout.lens, acc.tolist())):
        if 0 < a < n <= 8:
            assert bool(dirty[0][layout.rows(i)][a:].isnan().all()), f"request {i}"
    states = [c["recurrent_state"].clone() for _ in range(2)]
    for st_, (_, rings) in zip(states, (clean, dirty)):
        gated_delta_rule_commit_triton(st_, *rings, layout.qsl, layout.slots, acc, plan=plan)
    assert torch.equal(states[0], states[1]) and torch.isfinite(states[1]).all()


def test_gdn_plan_rule_and_checks():
    """The block form from 8 requests at 6 rows a request on, where gates are a head's and
    K, V >= 16; a bad plan is refused before any launch, naming the field, the value and the
    rule."""
    from dspark_compile.kernels.gdn import _check_plan, plan_gdn

    assert plan_gdn(64, 32, 128, 128, 132, num_tokens=384).block_rows == 8
    assert plan_gdn(64, 32, 128, 128, 132, num_tokens=383).block_rows == 0  # under 6 a request
    assert plan_gdn(64, 32, 128, 128, 132).block_rows == 0  # rows unknown
    assert plan_gdn(8, 32, 128, 128, 132, num_tokens=48).block_rows == 8
    assert plan_gdn(7, 32, 128, 128, 132, num_tokens=56).block_rows == 0
    assert plan_gdn(64, 32, 128, 128, 132, channel_gates=True, num_tokens=512).block_rows == 0
    assert plan_gdn(64, 32, 8, 128, 132, num_tokens=512).block_rows == 0  # K < 16: no dots
    assert plan_gdn(1, 4, 16, 16, 132, block_form=True).block_rows == 8
    plan = plan_gdn(64, 32, 128, 128, 132, num_tokens=512)
    _check_plan(plan, False)
    for fields, match in [({"block_rows": 4}, "block_rows=4: must be 0 or 8"),
                          ({"block_form_v": 48}, "block_form_v=48: must be a power of two"),
                          ({"block_form_v": 8}, "block_form_v=8"),
                          ({"walk_v": 128}, "walk_v=128: must be a power of two .* dividing"),
                          ({"block_wait_polls": -1}, "block_wait_polls=-1: must be an int"),
                          ({"block_stream_kc": 24}, "block_stream_kc=24: must be a power"),
                          ({"block_stream_kc": 256}, "block_stream_kc=256: .* up to k_pad"),
                          ({"block_weights_registers": 16},
                           "block_weights_registers=16: must be 0 .* or at least 32"),
                          ({"block_weights_warps": 3},
                           r"block_weights_warps=3: must be 0 \(block_form_warps\), 1, 2, 4 or 8")]:
        with pytest.raises(ValueError, match=match):
            _check_plan(dataclasses.replace(plan, **fields), False)
    with pytest.raises(ValueError, match="one gate a key channel"):
        _check_plan(plan, True)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, on the poisoned rows
def test_triton_containment_and_shape_errors():
    from dspark_compile.kernels.conv import causal_conv1d_triton
    from dspark_compile.kernels.gdn import (gated_delta_rule_commit_triton,
                                                    gated_delta_rule_triton)

    layout = make_layout([4, 0, 3], num_pad=2, seed=5)
    acc = torch.tensor([2, 0, 1], dtype=torch.int32)
    c = conv_case(layout, dim=21, seed=5)
    _check_containment(layout, acc, run_conv(c, layout, impl=causal_conv1d_triton),
                       run_conv({**c, "x": _poison(c["x"], layout, acc)}, layout,
                                impl=causal_conv1d_triton))
    c = gdn_case(layout, 1, 2, 16, 16, seed=5)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("q", "k", "v", "g", "beta")}}
    clean = run_gdn(c, layout, impl=gated_delta_rule_triton)
    dirty = run_gdn(d, layout, impl=gated_delta_rule_triton)
    _check_containment(layout, acc, clean, dirty)
    states = [c["recurrent_state"].clone() for _ in range(2)]
    for st_, (_, rings) in zip(states, (clean, dirty)):
        gated_delta_rule_commit_triton(st_, *rings, layout.qsl, layout.slots, acc)
    assert torch.equal(states[0], states[1]) and torch.isfinite(states[1]).all()
    with pytest.raises(ValueError, match="conv_state has shape"):
        causal_conv1d_triton(c["v"][:, 0], torch.zeros(16, 4), None, torch.zeros(3, 16, 2),
                             layout.qsl, layout.slots, torch.zeros(9, 16), "silu")
    with pytest.raises(ValueError, match="2 <= width <= 4"):
        causal_conv1d_triton(c["v"][:, 0], torch.zeros(16, 5), None, torch.zeros(3, 16, 4),
                             layout.qsl, layout.slots, torch.zeros(9, 16), "silu")
    with pytest.raises(ValueError, match="recurrent_state has dtype"):
        gated_delta_rule_triton(c["q"], c["k"], c["v"], c["g"], c["beta"],
                                c["recurrent_state"].double(), layout.qsl, layout.slots,
                                *clean[1], 0.25, True)


# ------------------------------------------------------------------ GPU, real shapes

def _gpu_layout(bs, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 9, (bs,), generator=g).tolist()
    lens[0] = 0 if bs > 1 else lens[0]  # an empty request slot among real ones
    return make_layout(lens, num_pad=5, extra_slots=3, seed=seed, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_pytorch_tanh", "none"])
def test_gpu_conv_float32_activations_match_reference_tightly(activation):
    """float32 on the GPU against the reference op: tight enough to tell erf GELU from its tanh
    form (they differ by up to ~5e-4)."""
    layout = _gpu_layout(16, 5)
    c = conv_case(layout, dim=512, width=4, seed=5, dtype=torch.float32, device="cuda")
    want, want_ring = run_conv(c, layout, activation)
    got, ring = run_conv(c, layout, activation, impl=OPS.causal_conv1d_triton)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(ring, want_ring)


@pytest.mark.gpu
@pytest.mark.parametrize("bs, activation", [(1, "silu"), (64, "silu"), (64, "gelu"),
                                            (8, "gelu_pytorch_tanh"), (8, "none")])
def test_gpu_conv_bf16_qwen3_next(bs, activation):
    layout = _gpu_layout(bs, bs)
    c = conv_case(layout, dim=8192, width=4, seed=bs, dtype=torch.bfloat16, device="cuda")
    c32 = {n: (t.float() if t is not None else None) for n, t in c.items()}
    want, want_ring = run_conv(c32, layout, activation)
    got, ring = run_conv(c, layout, activation, impl=OPS.causal_conv1d_triton)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    assert torch.equal(ring.float(), want_ring)
    acc, state = accepts(layout, bs), c["conv_state"].clone()
    OPS.causal_conv1d_commit_triton(state, ring, layout.qsl, layout.slots, acc)
    want_state = c32["conv_state"].clone()
    OPS.causal_conv1d_commit(want_state, want_ring, layout.qsl, layout.slots, acc)
    assert torch.equal(state.float(), want_state)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 8, 64])
def test_gpu_gdn_bf16_qwen3_next(bs):
    layout = _gpu_layout(bs, bs)
    c = gdn_case(layout, 16, 32, 128, 128, seed=bs, dtype=torch.bfloat16, device="cuda")
    c32 = {n: t.float() for n, t in c.items()}
    want, want_rings = run_gdn(c32, layout)
    got, rings = run_gdn(c, layout, impl=OPS.gated_delta_rule_triton)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    acc = accepts(layout, bs)
    state, want_state = c["recurrent_state"].clone(), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit_triton(state, *rings, layout.qsl, layout.slots, acc)
    OPS.gated_delta_rule_commit(want_state, *want_rings, layout.qsl, layout.slots, acc)
    torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("dtype, hk, hv, kd, vd", [(torch.bfloat16, 2, 4, 40, 32),
                                                   (torch.float16, 4, 8, 256, 64),
                                                   (torch.bfloat16, 1, 3, 72, 48)])
def test_gpu_gdn_block_native_gram_shapes(dtype, hk, hv, kd, vd):
    """The weight programs' one-product Gram on the GPU beyond Qwen3-Next's shapes (K past a
    power of two, K = 256, three value heads a key head, float16): the block form against the
    reference, against the float32 chunks to float32 rounding, and rejected rows contained."""
    from dspark_compile.kernels.gdn import gated_delta_rule_triton

    layout = make_layout([8, 3, 0, 11, 5, 8, 8, 7, 8, 6], num_pad=3, seed=kd, device="cuda")
    c = gdn_case(layout, hk, hv, kd, vd, seed=kd, dtype=dtype, device="cuda")
    plan = _gdn_plan(layout, hv, kd, vd, "block")
    got, rings = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    want, want_rings = run_gdn({n: t.float() for n, t in c.items()}, layout)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(rings[0], want_rings[0], atol=1e-5, rtol=1e-5)
    chunks, _ = run_gdn(c, layout, impl=gated_delta_rule_triton,
                        plan=dataclasses.replace(plan, block_gram="ieee"))
    torch.testing.assert_close(got.float(), chunks.float(), atol=1e-3, rtol=2 ** -7)
    acc = accepts(layout, kd)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("q", "k", "v", "g", "beta")}}
    dirty = run_gdn(d, layout, impl=gated_delta_rule_triton, plan=plan)
    _check_containment(layout, acc, (got, rings), dirty)


@pytest.mark.gpu
def test_gpu_opcheck_triton_ops():
    layout = make_layout([3, 0, 5], num_pad=2, device="cuda")
    c = conv_case(layout, dim=256, dtype=torch.bfloat16, device="cuda")
    ring = torch.zeros_like(c["x"])
    torch.library.opcheck(OPS.causal_conv1d_triton.default, (
        c["x"], c["weight"], c["bias"], c["conv_state"], layout.qsl, layout.slots, ring, "silu"))
    torch.library.opcheck(OPS.causal_conv1d_commit_triton.default, (
        c["conv_state"], ring, layout.qsl, layout.slots, accepts(layout)))
    d = gdn_case(layout, 2, 4, 64, 64, dtype=torch.bfloat16, device="cuda")
    rings = linear_ops.gdn_ring(layout.num_tokens, 2, 4, 64, 64, "cuda")
    torch.library.opcheck(OPS.gated_delta_rule_triton.default, (
        d["q"], d["k"], d["v"], d["g"], d["beta"], d["recurrent_state"], layout.qsl,
        layout.slots, *rings, 0.125, True))
    torch.library.opcheck(OPS.gated_delta_rule_commit_triton.default, (
        d["recurrent_state"], *rings, layout.qsl, layout.slots, accepts(layout)))


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_another_layout():
    """Conv + GDN forward and commits captured once, replayed with other lengths and slots
    written into the same layout buffers: no host sync, nothing keyed on the first layout."""
    # 8 requests: the GDN forward's block form by default (plan_gdn); lay_b's 11-row request
    # walks inside it
    lay_a = make_layout([3, 8, 1, 5, 2, 8, 4, 1], 3, 4, 1, "cuda")
    lay_b = make_layout([8, 0, 3, 6, 11, 2, 1, 1], 3, 4, 2, "cuda")  # same N (32) and R
    c = conv_case(lay_a, dim=8192, seed=3, dtype=torch.bfloat16, device="cuda")
    d = gdn_case(lay_a, 16, 32, 128, 128, seed=3, dtype=torch.bfloat16, device="cuda")
    qsl, slots, acc = lay_a.qsl.clone(), lay_a.slots.clone(), accepts(lay_a)
    pools = c["conv_state"].clone(), d["recurrent_state"].clone()

    def step(ops, conv_pool, gdn_pool, qsl, slots, acc):
        ring = torch.zeros_like(c["x"])
        rings = linear_ops.gdn_ring(lay_a.num_tokens, 16, 32, 128, 128, "cuda")
        y = ops[0](c["x"], c["weight"], c["bias"], conv_pool, qsl, slots, ring, "silu")
        ops[1](conv_pool, ring, qsl, slots, acc)
        o = ops[2](d["q"], d["k"], d["v"], d["g"], d["beta"], gdn_pool, qsl, slots, *rings,
                   128 ** -0.5, True)
        ops[3](gdn_pool, *rings, qsl, slots, acc)
        return y, o

    triton_ops = (OPS.causal_conv1d_triton, OPS.causal_conv1d_commit_triton,
                  OPS.gated_delta_rule_triton, OPS.gated_delta_rule_commit_triton)
    step(triton_ops, *[p.clone() for p in pools], qsl, slots, acc)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(triton_ops, *pools, qsl, slots, acc)
    qsl.copy_(lay_b.qsl)
    slots.copy_(lay_b.slots)
    acc.copy_(accepts(lay_b))
    pools[0].copy_(c["conv_state"])
    pools[1].copy_(d["recurrent_state"])
    graph.replay()
    want_pools = c["conv_state"].clone(), d["recurrent_state"].clone()
    want = step((OPS.causal_conv1d, OPS.causal_conv1d_commit, OPS.gated_delta_rule,
                 OPS.gated_delta_rule_commit), *want_pools, lay_b.qsl, lay_b.slots, acc)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_.float(), w_.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(pools[0], want_pools[0])
    torch.testing.assert_close(pools[1], want_pools[1], atol=1e-4, rtol=1e-4)
    eager_pools = c["conv_state"].clone(), d["recurrent_state"].clone()  # the replay: eager's
    eager = step(triton_ops, *eager_pools, lay_b.qsl, lay_b.slots, acc)
    assert all(torch.equal(g_, e_) for g_, e_ in zip(got, eager))
    assert all(torch.equal(p_, e_) for p_, e_ in zip(pools, eager_pools))


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[3, 1, 8, 2, 5, 1, 7, 4] * 4, [40, 3, 16, 17]])
def test_gpu_gdn_float32_matches_reference_closely(lens):
    """float32 at Qwen3-Next's shapes, verify widths and prefill lengths: to float32 rounding
    of the reference."""
    layout = make_layout(lens, num_pad=3, seed=9, device="cuda")
    c = gdn_case(layout, 16, 32, 128, 128, seed=9, device="cuda")
    want, want_rings = run_gdn(c, layout)
    got, rings = run_gdn(c, layout, impl=OPS.gated_delta_rule_triton)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for r, w in zip(rings, want_rings):
        torch.testing.assert_close(r, w, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("form", ["rows", "block"])
def test_gpu_gdn_contains_rejected_rows(form):
    """NaN and Inf in rejected and padding rows, bf16 at Qwen3-Next's shapes on the GPU, in
    both forms (a 12-row request walks inside the block form): accepted rows and the committed
    state bit for bit, and the block form agrees with the row walk; its stream programs give
    the same bits whether they read the weight programs' results or make their own."""
    from dspark_compile.kernels.gdn import gated_delta_rule_commit_triton, gated_delta_rule_triton

    layout = make_layout([8, 3, 0, 5, 1, 12, 8, 2], num_pad=3, seed=6, device="cuda")
    acc = accepts(layout, 6)
    c = gdn_case(layout, 16, 32, 128, 128, seed=6, dtype=torch.bfloat16, device="cuda")
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("q", "k", "v", "g", "beta")}}
    plan = _gdn_plan(layout, 32, 128, 128, form)
    clean = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    _check_containment(layout, acc, clean,
                       run_gdn(d, layout, impl=gated_delta_rule_triton, plan=plan))
    if form == "block":  # every stream program making its own weights: the same bits
        last = run_gdn(d, layout, impl=gated_delta_rule_triton,
                       plan=dataclasses.replace(plan, block_weights_first=False,
                                            block_wait_polls=0))
        dirty = run_gdn(d, layout, impl=gated_delta_rule_triton, plan=plan)
        assert torch.equal(last[0].nan_to_num(), dirty[0].nan_to_num())
        # the weight programs in a launch of their own (PDL on the H200): the same bits
        split = run_gdn(d, layout, impl=gated_delta_rule_triton,
                        plan=dataclasses.replace(plan, block_weights_launch=True,
                                                 block_weights_registers=80))
        assert torch.equal(split[0].nan_to_num(), dirty[0].nan_to_num())
    rows = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=_gdn_plan(layout, 32, 128, 128,
                                                                           "rows"))
    torch.testing.assert_close(clean[0].float(), rows[0].float(), atol=2e-2, rtol=2e-2)
    states = [c["recurrent_state"].clone() for _ in range(2)]
    for st_, (_, rings) in zip(states, (clean, rows)):
        gated_delta_rule_commit_triton(st_, *rings, layout.qsl, layout.slots, acc)
    torch.testing.assert_close(states[0], states[1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ one gate a key channel (KDA)

def hf_kda(c, layout, i, upto=None, chunk=False):
    """Kimi Linear's KDA on request i alone from pool[slot]: (out [L, Hv, V], final state)."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    rows = layout.rows(i, upto)
    fn = kimi.chunk_kimi_delta_attention if chunk else kimi.recurrent_kimi_delta_attention
    out, state = fn(*(c[n][rows][None] for n in ("q", "k", "v", "g", "beta")),
                    initial_state=c["recurrent_state"][layout.slots[i]][None].clone(),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_channel_gates_match_kimi_kda_and_commit(name):
    """g [N, Hv, K] (Kimi Linear): every request's rows equal HF's recurrent and chunked KDA
    from its slot, and the commit equals HF's state after the accepted rows."""
    layout = make_layout(*LAYOUTS[name], seed=5)
    c = gdn_case(layout, 3, 3, 16, 24, seed=5, channel_gates=True)
    out, rings = run_gdn(c, layout)
    assert rings[2].shape == (layout.num_tokens, 3, 16)
    for i, n in enumerate(layout.lens):
        if n:
            for chunk in (False, True):
                torch.testing.assert_close(out[layout.rows(i)],
                                           hf_kda(c, layout, i, chunk=chunk)[0],
                                           atol=2e-5, rtol=1e-4)
    real = sum(layout.lens)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    acc, committed = accepts(layout, seed=5), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit(committed, *rings, layout.qsl, layout.slots, acc)
    want = c["recurrent_state"].clone()
    for i, a in enumerate(acc.tolist()):
        if a:
            want[int(layout.slots[i])] = hf_kda(c, layout, i, upto=a)[1]
    torch.testing.assert_close(committed, want, atol=2e-6, rtol=1e-5)


def test_channel_gates_are_not_head_gates():
    """The same log decays spread over every channel of a head equal one gate a head, and a
    different decay per channel changes the result (the channel axis is read, not dropped)."""
    layout = make_layout([3, 5], num_pad=1, seed=2)
    c = gdn_case(layout, 1, 2, 8, 8, seed=2)
    spread = {**c, "g": c["g"][..., None].expand(-1, -1, 8).contiguous()}
    torch.testing.assert_close(run_gdn(spread, layout)[0], run_gdn(c, layout)[0], atol=1e-6,
                               rtol=1e-6)
    varied = {**spread, "g": spread["g"] * torch.linspace(0.5, 1.5, 8)}
    assert not torch.allclose(run_gdn(varied, layout)[0], run_gdn(c, layout)[0], atol=1e-3)


def test_channel_gate_argument_errors():
    layout = make_layout([2, 3], num_pad=0)
    c = gdn_case(layout, 1, 2, 8, 8, channel_gates=True)
    rings = linear_ops.gdn_ring(5, 1, 2, 8, 8, "cpu", channel_gates=True)
    args = [c["q"], c["k"], c["v"], c["g"], c["beta"], c["recurrent_state"], layout.qsl,
            layout.slots, *rings, 0.25, True]
    with pytest.raises(ValueError, match=r"\[N, Hv, K\] = \(5, 2, 8\)"):
        OPS.gated_delta_rule(*args[:3], c["g"][..., :4], *args[4:])
    head_rings = linear_ops.gdn_ring(5, 1, 2, 8, 8, "cpu")
    with pytest.raises(ValueError, match="ring_g must be a float32 tensor shaped like g's rows"):
        OPS.gated_delta_rule(*args[:8], *head_rings, 0.25, True)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy, on the poisoned rows
@pytest.mark.parametrize("name", ["mixed", "long"])
def test_triton_channel_gates_match_reference_and_contain(name):
    from dspark_compile.kernels.gdn import (GdnPlan, gated_delta_rule_commit_triton,
                                            gated_delta_rule_triton)

    layout = make_layout(*TRITON_LAYOUTS[name], seed=3)
    c = gdn_case(layout, 2, 4, 16, 32, seed=3, channel_gates=True)
    want, want_rings = run_gdn(c, layout)
    plan = GdnPlan(16, 16, 2)  # two channel blocks: only the first saves g
    t = {**c, **{n: _strided(c[n]) for n in ("q", "k", "v", "g", "beta")}}
    got, rings = run_gdn(t, layout, impl=gated_delta_rule_triton, plan=plan)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for r, w in zip(rings, want_rings):
        torch.testing.assert_close(r, w, atol=1e-6, rtol=1e-6)
    acc = accepts(layout, seed=3)
    want_state, state = c["recurrent_state"].clone(), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit(want_state, *want_rings, layout.qsl, layout.slots, acc)
    gated_delta_rule_commit_triton(state, *rings, layout.qsl, layout.slots, acc, plan=plan)
    torch.testing.assert_close(state, want_state, atol=2e-6, rtol=1e-5)
    d = {**c, **{n: _poison(c[n], layout, acc) for n in ("q", "k", "v", "g", "beta")}}
    clean = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    dirty = run_gdn(d, layout, impl=gated_delta_rule_triton, plan=plan)
    _check_containment(layout, acc, clean, dirty)
    states = [c["recurrent_state"].clone() for _ in range(2)]
    for st_, (_, r) in zip(states, (clean, dirty)):
        gated_delta_rule_commit_triton(st_, *r, layout.qsl, layout.slots, acc, plan=plan)
    assert torch.equal(states[0], states[1]) and torch.isfinite(states[1]).all()


@needs_triton
@pytest.mark.parametrize("channel_gates, form", [(False, "rows"), (True, "rows"),
                                                 (False, "block")])
@pytest.mark.parametrize("regime", ["strong", "zero", "grow"])
def test_triton_gdn_extreme_decays_match_reference(channel_gates, form, regime):
    """Decays at the ends of their range: e^-5..e^-40 a row (a state that forgets within a row
    or two), exactly 0 (``g = -inf``) and growth (``g > 0``); outputs and the committed state
    must match the reference."""
    from dspark_compile.kernels.gdn import gated_delta_rule_commit_triton, gated_delta_rule_triton

    name = "long" if regime == "strong" and form == "rows" else "mixed"
    layout = make_layout(*TRITON_LAYOUTS[name], seed=11)
    c = gdn_case(layout, 2, 4, 16, 32, seed=11, channel_gates=channel_gates)
    plan = None if form == "rows" else _gdn_plan(layout, 4, 16, 32, "block")
    gen = torch.Generator().manual_seed(12)
    if regime == "strong":
        c["g"] = -5.0 - 35.0 * torch.rand(c["g"].shape, generator=gen)
    elif regime == "zero":
        c["g"] = torch.where(torch.rand(c["g"].shape, generator=gen) < 0.3, -INF, c["g"])
    else:  # e^2..e^4 a row: an 8-row request passes 2^40
        c["g"] = 2.0 + 2.0 * torch.rand(c["g"].shape, generator=gen)
    want, want_rings = run_gdn(c, layout)
    got, rings = run_gdn(c, layout, impl=gated_delta_rule_triton, plan=plan)
    assert torch.isfinite(want).all()
    # a growing state's delta rule cancels (v - S^T k with S^T k large), which the reference
    # rounds too: growth is judged against each row's largest value
    close = _close_per_row if regime == "grow" else functools.partial(
        torch.testing.assert_close, atol=2e-6, rtol=1e-5)
    close(got, want)
    acc = accepts(layout, seed=11)
    want_state, state = c["recurrent_state"].clone(), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit(want_state, *want_rings, layout.qsl, layout.slots, acc)
    gated_delta_rule_commit_triton(state, *rings, layout.qsl, layout.slots, acc, plan=plan)
    close(state, want_state)


def _close_per_row(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5, atol: float = 2e-6):
    """Every element within ``rtol`` of its row's largest magnitude (last axis), plus ``atol``."""
    bound = rtol * want.abs().amax(-1, keepdim=True) + atol
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"worst error over bound: {float((err / bound).max()):.3g}"


@pytest.mark.gpu
def test_gpu_channel_gates_float32_matches_reference_closely():
    """Kimi Linear's shapes (32 heads, K = V = 128, one gate a key channel), float32, verify
    widths and a prefill length, on the GPU."""
    layout = make_layout([3, 1, 8, 2, 5, 1, 7, 4] * 2 + [40], num_pad=3, seed=4, device="cuda")
    c = gdn_case(layout, 32, 32, 128, 128, seed=4, device="cuda", channel_gates=True)
    want, want_rings = run_gdn(c, layout)
    got, rings = run_gdn(c, layout, impl=OPS.gated_delta_rule_triton)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for r, w in zip(rings, want_rings):
        torch.testing.assert_close(r, w, atol=1e-6, rtol=1e-6)
    acc = accepts(layout, 4)
    want_state, state = c["recurrent_state"].clone(), c["recurrent_state"].clone()
    OPS.gated_delta_rule_commit(want_state, *want_rings, layout.qsl, layout.slots, acc)
    OPS.gated_delta_rule_commit_triton(state, *rings, layout.qsl, layout.slots, acc)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
