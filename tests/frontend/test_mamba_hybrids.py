"""Mamba-2 hybrids (and LFM2's short conv) against HF transformers' own forward.

Each family's mixers are recognised from the calls their forward makes (``causal_conv1d_fn``
and ``mamba2_chunk_scan``) and compiled to ``dspark::causal_conv1d`` + ``dspark::ssd``. Every
ragged logit row equals HF's forward (``use_cache=False``) over that request's prompt +
committed + new tokens alone, over a prefill and three verify/commit rounds with random lengths
and accepted prefixes (float32, CPU, reference ops). HF scans in chunks of 4, the op token by
token, so rows agree to float32 rounding (max errors 6e-8 to 6e-7 at f31adbe), not bitwise.
Containment: a NaN token at rejected draft positions leaves the accepted outputs and the
committed conv and SSM state bit-identical to a clean run. Mamba-1 mixers (Mamba, Falcon-Mamba,
Jamba) run as one-element Mamba-2 heads and equal HF too, and so does Zamba, whose mixer runs
one conv and a Mamba-1 scan per head (each scan after the first a layer of its own, with no conv
window); mixers that run their conv themselves are refused naming the module.
"""

import random

import pytest
import torch

from dspark_compile import VerifyLayout, dspark_compile
from helpers import Session, assert_nan_drafts_contained, ragged_rounds_error, with_forward
from ssm_models import FAMILIES, MAMBA1, VOCAB, tiny_ssm

TOL = 1e-4
POISON = VOCAB - 1  # a token id whose embedding row is NaN in the containment test
_compiled: dict = {}


def compiled(family: str):
    if family not in _compiled:
        model = tiny_ssm(family)
        _compiled[family] = model, dspark_compile(model)
    return _compiled[family]


@pytest.mark.parametrize("family", [*FAMILIES, "lfm2"])
def test_ragged_equals_hf_forward(family):
    model, verifier = compiled(family)
    done = {r.name: r.changed for r in verifier.results}
    mixers = len(verifier.adapter.linear_specs)
    assert mixers >= 1 and done["ragged_conv"] == mixers
    assert done["ragged_ssd"] == (0 if family == "lfm2" else mixers)
    ops = {str(n.target) for n in verifier.graph_module.graph.nodes if n.op == "call_function"}
    assert not any("dense_" in op for op in ops), ops
    session = Session(model, verifier, [2, 0], seed=1)
    session.vocab = POISON
    session.step([5, 7], accept=[5, 7])
    rng = random.Random(1)
    for _ in range(3):
        session.step([rng.randint(1, 6), rng.randint(1, 6)])
    assert session.max_err < TOL, f"{family}: max |ragged - HF| = {session.max_err}"


def _linear_state(state):
    return [t.clone() for t in (*state.linear.conv_states, *state.linear.recurrent_states)]


def _step(verifier, state, tokens, context, slots):
    layout = VerifyLayout.pack([t.numel() for t in tokens], context, slots)
    return verifier(torch.cat(tokens), layout, state), layout


@pytest.mark.parametrize("captured", [False, True])
def test_nan_draft_cannot_reach_accepted_rows_or_state(captured):
    """Rejected drafts hold a token with a NaN embedding: nothing accepted changes, bitwise,
    through the eager commit, and through the static buffers and commit of captured sessions
    (``captured``: both sessions, so both have one padded shape; a CPU BLAS may round a row by
    the row count around it)."""
    model, verifier = compiled("nemotron_h")
    gen = torch.Generator().manual_seed(2)
    slots, prompts = [3, 1], [6, 4]
    states = [verifier.new_state(max_requests=4, max_context=64) for _ in range(2)]
    for state in states if captured else ():
        verifier.capture(state, block=8, use_graphs=False)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        saved = embed[POISON].clone()
        embed[POISON] = float("nan")
    try:
        prompt = [torch.randint(0, POISON, (n,), generator=gen) for n in prompts]
        for state in states:
            _, layout = _step(verifier, state, prompt, [0, 0], slots)
            verifier.commit(layout, prompts, state)
        ctx, rng = list(prompts), random.Random(2)
        for _ in range(3):
            lens = [rng.randint(2, 7) for _ in slots]
            accept = [rng.randint(1, n - 1) for n in lens]  # always something rejected
            clean = [torch.randint(0, POISON, (n,), generator=gen) for n in lens]
            poisoned = [torch.cat([c[:a], torch.full((n - a,), POISON)])
                        for c, a, n in zip(clean, accept, lens)]
            outs = []
            for state, tokens in zip(states, (clean, poisoned)):
                logits, layout = _step(verifier, state, tokens, ctx, slots)
                verifier.commit(layout, accept, state)
                outs.append(logits.clone())
            qsl = layout.query_start_loc.tolist()
            for i, a in enumerate(accept):
                rows = slice(qsl[i], qsl[i] + a)
                assert torch.isfinite(outs[0][rows]).all()
                assert torch.equal(outs[0][rows], outs[1][rows]), f"request {i}"
            assert not torch.isfinite(outs[1]).all(), "the poison token must produce NaN"
            for a, b in zip(_linear_state(states[0]), _linear_state(states[1])):
                assert torch.equal(a, b)
            ctx = [c + a for c, a in zip(ctx, accept)]
    finally:
        with torch.no_grad():
            embed[POISON] = saved


@pytest.mark.parametrize("family", MAMBA1)
def test_mamba1_equals_hf_forward(family):
    """Mamba-1 mixers (``mamba_selective_scan``) run as one-element Mamba-2 heads: every ragged
    row equals HF's forward over a prefill and three rounds."""
    model, verifier = compiled(family)
    specs = verifier.adapter.linear_specs
    assert specs and all(s.kind == "ssd" and (s.head_k_dim, s.head_v_dim) == (1, 1)
                         for s in specs)
    err = ragged_rounds_error(model, verifier, [1, 0], [6, 4], POISON, seed=3, rounds=3,
                             max_len=6)
    assert err < TOL, f"{family}: max |ragged - HF| = {err}"


def test_zamba_scans_per_head_equal_hf_forward():
    """Zamba's mixer: one conv, then a scan per mamba head; the first scan goes with the conv,
    each further one is a scan layer of its own. Every ragged row equals HF's."""
    model, verifier = compiled("zamba")
    specs = verifier.adapter.linear_specs
    heads = model.config.n_mamba_heads
    assert [s.kind for s in specs] == (["ssd"] + ["scan"] * (heads - 1)) * \
        (len(specs) // heads)
    err = ragged_rounds_error(model, verifier, [1, 0], [6, 4], POISON, seed=3, rounds=3,
                              max_len=6)
    assert err < TOL, f"zamba: max |ragged - HF| = {err}"


def test_zamba_scans_sharing_one_state_are_refused(monkeypatch):
    """Every scan of a run reading the mixer's first state is caught by the call check."""
    from dspark_compile.frontend import recurrent

    site = recurrent.RecurrentLayers.site
    monkeypatch.setattr(recurrent.RecurrentLayers, "site",
                        lambda self, function, scan=False: site(self, function))
    with pytest.raises(RuntimeError, match=r"made the calls \['conv', 'ssd', 'ssd'\] while "
                                           r"captured but \['conv', 'ssd'\]"):
        dspark_compile(tiny_ssm("zamba"))


def test_mamba1_nan_draft_cannot_reach_accepted_rows_or_state():
    model, verifier = compiled("mamba")
    assert_nan_drafts_contained(model, verifier, POISON, [0, 1], [5, 3], [5, 4], [2, 3],
                                seed=5)


def test_a_mixer_running_its_own_conv_is_refused_by_name():
    """A short-conv mixer rewritten to call its ``nn.Conv1d`` over the tokens itself (what a
    mixer written without HF's functions does) is refused before any graph exists."""
    model = tiny_ssm("lfm2")
    mixer = model.model.layers[0].conv

    def forward(self, hidden_states, **kwargs):
        b, c, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        y = self.conv(b * x)[..., :hidden_states.shape[1]]
        return self.out_proj((c * y).transpose(-1, -2))

    with_forward(mixer, forward)
    with pytest.raises(NotImplementedError,
                       match=r"Lfm2ShortConv 'model.layers.0.conv' runs a causal depthwise "
                             r"nn.Conv1d \(Conv1d 'model.layers.0.conv.conv'\)"):
        dspark_compile(model)


def test_triton_lowering_takes_the_ssd_kernel_and_its_commit():
    """``lower`` swaps ``dspark::ssd`` for its Triton twin; the verifier's commit table holds
    the Triton commit under the Triton lowering (no device needed to check either)."""
    from dspark_compile import DSparkConfig
    from dspark_compile.kernels.ops import LOWERED
    from dspark_compile.passes import PassContext, lower
    from dspark_compile.passes.retrace import copy_module

    _, verifier = compiled("mamba2")
    gm = copy_module(verifier.graph_module)
    ctx = PassContext(None, None, list(verifier.inputs), DSparkConfig().resolve("cuda"))
    lower.run(gm, ctx)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"dspark.ssd_triton.default", "dspark.causal_conv1d_triton.default"} <= targets
    ops = torch.ops.dspark
    assert LOWERED["triton"][ops.ssd_commit] is ops.ssd_commit_triton


@pytest.mark.parametrize("change, match", [
    ("z", r"Mamba2Mixer 'backbone.layers.0.mixer' \(mamba2_chunk_scan\) passes \['z'\]"),
    ("twice", r"Mamba2Mixer 'backbone.layers.0.mixer' \(mamba2_chunk_scan\) made a second "
              r"'ssd' call"),
    ("no_conv", r"Mamba2Mixer 'backbone.layers.0.mixer' mixes tokens through \['ssd'\]"),
], ids=["gated scan", "two scans", "scan without its conv"])
def test_scan_calls_outside_the_whitelist_are_refused_naming_the_mixer(change, match):
    """What the capture does not implement (a z gate inside the scan, two scans in one mixer, a
    scan whose conv is not HF's causal_conv1d_fn) is refused at discovery, naming the mixer."""
    from transformers.models.mamba2 import modeling_mamba2 as hf

    def forward(self, hidden_states, **kwargs):  # HF's mixer, cut down and changed
        bs, t, _ = hidden_states.shape
        gate, xbc, dt = self.in_proj(hidden_states).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        if change != "no_conv":
            xbc = hf.causal_conv1d_fn(xbc.transpose(1, 2), self.conv1d.weight.squeeze(1),
                                      self.conv1d.bias, activation="silu").transpose(1, 2)
        groups = self.n_groups * self.ssm_state_size
        x, b, c = xbc.split([self.intermediate_size, groups, groups], dim=-1)
        args = (x.view(bs, t, self.num_heads, self.head_dim), dt, -torch.exp(self.A_log),
                b.view(bs, t, self.n_groups, -1), c.view(bs, t, self.n_groups, -1))
        kw = dict(chunk_size=self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                  dt_softplus=True, z=gate.view(*x.shape[:2], -1) if change == "z" else None)
        y = hf.mamba2_chunk_scan(*args, **kw)  # the capture's replacement, looked up now
        if change == "twice":
            y = y + hf.mamba2_chunk_scan(*args, **kw)
        return self.out_proj(y.reshape(bs, t, -1).to(hidden_states.dtype))

    model = tiny_ssm("mamba2")
    mixer = model.backbone.layers[0].mixer
    with_forward(mixer, forward)
    with pytest.raises(NotImplementedError, match=match):
        dspark_compile(model)
