"""A model that mixes tokens outside cached attention is refused at compile time, with the op,
the model's source line and what to do."""

import pytest
import torch
from torch import nn

from dspark_compile import RefusedOp, VerifyLayout, dspark_compile
from dspark_compile.nn import CachedAttention


class Mixer(nn.Module):
    """A one-layer decoder whose ``mix`` step is chosen by the test."""

    def __init__(self, mix):
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.norm = nn.LayerNorm(16)
        self.qkv = nn.Linear(16, 48)
        self.attn = CachedAttention(2, 2, 8)
        self.head = nn.Linear(16, 11)
        self.mix = mix

    def forward(self, ids, positions):
        x = self.embed(ids)
        x = self.mix(self.norm(x), positions)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).unbind(2)
        return self.head(self.attn(q, k, v).flatten(2))


def mean_over_sequence(x, positions):
    return x - x.mean(dim=1, keepdim=True)  # LINE: mean over the tokens


def cumsum_over_tokens(x, positions):
    return x.cumsum(dim=1)  # LINE: cumsum over the tokens


def own_positions(x, positions):
    return x + torch.arange(x.shape[1]).unsqueeze(-1).float()  # LINE: positions from arange


def raw_attention(x, positions):
    h = x.unsqueeze(1)  # [bs, 1, T, 16]
    return nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1)


def layer_norm_over_tokens(x, positions):
    return nn.functional.layer_norm(x, x.shape[1:])  # LINE: normalises over [T, 16]


def token_wise(x, positions):
    return x * torch.sigmoid(x) + positions.unsqueeze(-1).float() * 0.01


@pytest.mark.parametrize("mix, op, why", [
    (mean_over_sequence, "mean", "reduces, scans or reorders along the token axis"),
    (cumsum_over_tokens, "cumsum", "reduces, scans or reorders along the token axis"),
    (own_positions, "arange", "pass positions explicitly"),
    (raw_attention, "scaled_dot_product", "not known to be token-wise"),
    (layer_norm_over_tokens, "layer_norm", "normalises over the token axis"),
])
def test_token_mixing_is_refused_with_op_line_and_advice(mix, op, why):
    with pytest.raises(RefusedOp) as info:
        dspark_compile(Mixer(mix))
    message = str(info.value)
    assert op in message and why in message
    # The model's source line (the innermost forward() frame), not one of ours.
    assert "test_refusal.py" in message and "x = self.mix(self.norm(x), positions)" in message
    assert "CachedAttention" in message  # what to do


def fused_rms_norm(x, positions):
    # What nn.RMSNorm becomes on torch 2.11 (2.13 decomposes it): one op over trailing dims.
    return torch.ops.aten._fused_rms_norm(x, [16], None, 1e-6)[0]


@pytest.mark.parametrize("mix", [token_wise, fused_rms_norm])
def test_token_wise_model_compiles_and_matches(mix):
    model = Mixer(mix)
    verifier = dspark_compile(model)
    assert "ragged_attention: 1 rewritten" in verifier.explain()
    state = verifier.new_state(max_requests=2, max_context=16)
    ids = torch.tensor([1, 2, 3, 4, 5])
    logits = verifier(ids, VerifyLayout.pack([2, 3], [0, 0], [1, 0]), state)
    with torch.no_grad():
        want = model(ids[2:][None], torch.arange(3)[None])[0]
    torch.testing.assert_close(logits[2:], want, atol=1e-5, rtol=0)


def test_model_without_cached_attention_is_refused():
    with pytest.raises(TypeError, match="CachedAttention"):
        dspark_compile(nn.Linear(3, 3))
