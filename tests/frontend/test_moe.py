"""Mixture-of-experts layers: per-token expert routing is token-wise.

HF Qwen3-Next (Gated DeltaNet + gated attention, a sparse MoE in every layer) runs its experts
through transformers' experts interface as ``dspark::experts_route / experts_up /
experts_down`` while captured (``frontend/experts.py``; the other MoE families are in
``test_experts.py``); router and shared expert stay graph code. Every ragged logit row equals
HF's own forward over that request alone.

A plain decoder with the same routing pins down each rule and where it must refuse: gathering
token rows by index, tiling rows out of token-major order, top-k over the token axis.
"""

import random

import pytest
import torch
from torch import nn

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.passes import RefusedOp
from helpers import PlainBlock, PlainDecoder, Session, tiny_qwen3_next

TOL = 1e-4
VOCAB = 101


@pytest.fixture(scope="module")
def compiled():
    model = tiny_qwen3_next(vocab=VOCAB)
    return model, dspark_compile(model)


@pytest.mark.parametrize("slots,prompts,lens_fn", [
    ([5, 2, 7, 0], [4, 9, 3, 12], lambda r, n: [r.randint(1, 8) for _ in range(n)]),
    ([0, 1, 2], [3, 5, 8], lambda r, n: [2, 3, 2]),          # N not a multiple of bs
], ids=["random lengths, slots in any order", "N not a multiple of bs"])
def test_qwen3_next_ragged_equals_hf_forward(compiled, slots, prompts, lens_fn):
    model, verifier = compiled
    session = Session(model, verifier, slots, seed=1)
    session.vocab = VOCAB
    session.step(prompts, accept=prompts)
    rng = random.Random(1)
    for _ in range(4):
        session.step(lens_fn(rng, len(slots)))
    assert session.max_err < TOL, f"max |ragged - HF| = {session.max_err}"


def test_qwen3_next_capture_restores_the_experts_implementation(compiled):
    model, verifier = compiled
    assert model.config._experts_implementation == "grouped_mm"
    ops = [getattr(n.target, "__name__", "") for n in verifier.graph_module.graph.nodes]
    assert sum(op.startswith("experts_up") for op in ops) == 4
    done = {r.name: r.changed for r in verifier.results}
    assert done["ragged_conv"] == 2 and done["ragged_linear_attention"] == 2


def test_qwen3_next_nan_draft_cannot_reach_accepted_rows(compiled):
    """A NaN embedding at rejected drafts routes those rows anywhere; accepted rows and the
    committed linear state stay bit-identical to a clean run."""
    model, verifier = compiled
    poison, gen = VOCAB - 1, torch.Generator().manual_seed(2)
    lens, accept, prompts = [4, 6, 3], [2, 1, 2], [5, 3, 7]
    states = [verifier.new_state(max_requests=4, max_context=64) for _ in range(2)]
    prompt = torch.randint(0, poison, (sum(prompts),), generator=gen)
    clean = torch.randint(0, poison, (sum(lens),), generator=gen)
    keep = torch.cat([torch.arange(n) < a for n, a in zip(lens, accept)])
    with torch.no_grad():
        saved = model.model.embed_tokens.weight[poison].clone()
        model.model.embed_tokens.weight[poison] = float("nan")
    try:
        outs = []
        for state, tokens in zip(states, (clean, torch.where(keep, clean, poison))):
            prefill = VerifyLayout.pack(prompts, [0, 0, 0], [0, 1, 2])
            verifier(prompt, prefill, state)
            verifier.commit(prefill, prompts, state)
            layout = VerifyLayout.pack(lens, prompts, [0, 1, 2])
            outs.append(verifier(tokens, layout, state))
            verifier.commit(layout, accept, state)
    finally:
        with torch.no_grad():
            model.model.embed_tokens.weight[poison] = saved
    assert torch.isfinite(outs[0][keep]).all() and torch.equal(outs[0][keep], outs[1][keep])
    assert not torch.isfinite(outs[1]).all(), "the poison token must produce NaN"
    for a, b in zip(*(s.linear.recurrent_states for s in states)):
        assert torch.equal(a, b)


class MoEBlock(PlainBlock):
    """PlainBlock whose MLP is a top-k mixture of experts written like HF's batched_mm."""

    def __init__(self, dim, heads, kv_heads, mode="ok", experts=4, k=2):
        super().__init__(dim, heads, kv_heads)
        self.mode, self.k = mode, k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(experts, 2 * dim, dim) / dim ** 0.5)
        self.w_down = nn.Parameter(torch.randn(experts, dim, 2 * dim) / dim ** 0.5)

    def experts(self, x):  # x [bs, T, dim]
        bs, t, dim = x.shape
        probs = self.router(x).softmax(-1)
        if self.mode == "topk over tokens":
            probs = probs.topk(2, dim=1).values.sum(1, keepdim=True) * probs
        elif self.mode == "topk by default over tokens":  # [bs, E, T]: the last dim is T
            probs = probs.transpose(1, 2).topk(2).values.sum(-1).unsqueeze(1) * probs
        elif self.mode == "token rows times token rows":
            x = torch.bmm(torch.bmm(x, x.transpose(1, 2)), x)
        rows = x.reshape(-1, dim)
        weights, ids = probs.reshape(-1, probs.shape[-1]).topk(self.k)  # default dim: experts
        ids = ids.reshape(-1)
        if self.mode == "gather token rows":
            rows = rows[ids]  # a token reads another token's row
        elif self.mode == "tile rows":
            rows = rows.expand(self.k, -1, -1).reshape(-1, dim)  # [k, N] -> k*N: not token-major
        else:
            rows = rows.repeat_interleave(self.k, dim=0)
        if self.mode == "index a later dim":
            rows = rows + self.w_down[:, ids, 0].mean(0, keepdim=True).T
        up = torch.bmm(self.w_up[ids], rows.unsqueeze(-1)).squeeze(-1)
        out = torch.bmm(self.w_down[ids], nn.functional.gelu(up).unsqueeze(-1)).squeeze(-1)
        out = (out * weights.reshape(-1, 1)).view(-1, self.k, dim).sum(1)
        return out.view(bs, t, dim)

    def forward(self, x, positions):
        x = super().forward(x, positions)
        return x + self.experts(self.norm2(x))


def _decoder(mode="ok"):
    model = PlainDecoder(vocab=37, dim=32, heads=4, kv_heads=2, layers=1, seed=3)
    torch.manual_seed(3)
    model.blocks[0] = MoEBlock(32, 4, 2, mode)
    return model.eval()


def test_plain_moe_matches_own_forward():
    model = _decoder()
    session = Session(model, dspark_compile(model), [2, 0, 1], seed=5)
    session.vocab = 37
    session.step([3, 6, 2], accept=[3, 6, 2])
    for lens in ([2, 5, 1], [4, 1, 3], [1, 1, 7]):
        session.step(lens)
    assert session.max_err < 1e-5


@pytest.mark.parametrize("mode,why", [
    ("gather token rows", "gathers rows of a token value by index"),
    ("tile rows", "token-major order"),
    ("topk over tokens", "along the token axis"),
    ("topk by default over tokens", "along the token axis"),
    ("token rows times token rows", "refuses bmm.default"),  # [bs, T, T]: tokens meet
    ("index a later dim", "not along its first dim"),
])
def test_moe_routing_that_mixes_tokens_is_refused(mode, why):
    with pytest.raises(RefusedOp, match=why):
        dspark_compile(_decoder(mode))
