"""The compressed-attention ops (``ops/compressed.py``): each reference against an independent
computation (HF's DeepSeek-V4 modules over the whole sequence, a dense masked softmax), run as
ragged steps over NaN-poisoned pools with padding rows, the dense forms against the ragged
ones, and the fakes' refusals."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dspark_compile.ops  # noqa: F401  (registers the ops)
from dspark_compile.ops import compressed_reference as reference

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

OPS = torch.ops.dspark
PAGE, PAGES = 4, 24


def _config(rate_csa=2, rate_hca=4):
    return transformers.DeepseekV4Config(
        vocab_size=64, hidden_size=48, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
        q_lora_rank=24, num_hidden_layers=1, layer_types=["compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": rate_csa,
                        "heavily_compressed_attention": rate_hca},
        index_topk=3, index_n_heads=8, index_head_dim=16, sliding_window=4,
        max_position_embeddings=128)


def _module(cls, config, seed=0):
    torch.manual_seed(seed)
    m = cls(config).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1 or p.shape[0] in (2, 4):  # position biases and norm weights
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.2)
    return m


class Steps:
    """Two requests on slots 1 and 0 growing by ragged steps (with 2 padding rows each step)
    over NaN-poisoned pools; ``slot_tables`` spread each slot's pages."""

    def __init__(self, totals):
        self.totals, self.done = totals, [0, 0]
        self.table = torch.randperm(PAGES, generator=torch.Generator().manual_seed(1)).view(
            2, -1).int()

    def layout(self, lens):
        ctx = self.done
        qsl = torch.tensor([0, lens[0], lens[0] + lens[1]])
        seq = torch.tensor([ctx[0] + lens[0], ctx[1] + lens[1]])
        table = self.table[[1, 0]]
        rows = []
        for i in range(2):
            pos = torch.arange(ctx[i], ctx[i] + lens[i])
            rows.append(table[i].long()[pos // PAGE] * PAGE + pos % PAGE)
        slots = torch.cat(rows + [torch.full((2,), -1)])
        self.done = [c + n for c, n in zip(ctx, lens)]
        return qsl, seq, table, slots, ctx


STEPS = [[5, 3], [1, 4], [3, 0], [4, 2], [2, 5]]


def _pools(*widths):
    return [torch.full((PAGES, PAGE, w), float("nan")) for w in widths]


def _entries(pool, table_row, count):
    return reference._gather_keys(pool, table_row, 0, count)


@pytest.mark.parametrize("kind", ["hca", "csa", "indexer"])
def test_compress_matches_hf_module(kind):
    config = _config()
    if kind == "hca":
        m = _module(hf.DeepseekV4HCACompressor, config)
    else:
        m = _module(hf.DeepseekV4CSACompressor, config)
        m = m.indexer if kind == "indexer" else m
    overlap = kind != "hca"
    rate, dim = m.compress_rate, m.head_dim
    totals = [sum(s[0] for s in STEPS), sum(s[1] for s in STEPS)]
    gen = torch.Generator().manual_seed(2)
    hidden = [torch.randn(1, n, 48, generator=gen) for n in totals]
    with torch.no_grad():
        kv = [m.kv_proj(h)[0] for h in hidden]
        gate = [m.gate_proj(h)[0] for h in hidden]
        if kind == "indexer":  # the indexer returns picks; its entries are its compressor's
            want = [_indexer_entries(m, h) for h in hidden]
        else:
            want = [m(h, torch.zeros(1, h.shape[1], 24), torch.arange(h.shape[1])[None],
                      None, 0)[0][0, 0] for h in hidden]
    kv_pool, gate_pool, entry_pool = _pools(kv[0].shape[1], kv[0].shape[1], dim)
    steps = Steps(totals)
    for lens in STEPS:
        qsl, seq, table, slots, ctx = steps.layout(lens)
        rows = lambda xs: torch.cat([x[c:c + n] for x, c, n in zip(xs, ctx, lens)] +
                                    [torch.full((2, xs[0].shape[1]), float("nan"))])
        fresh = OPS.compress(rows(kv), rows(gate), kv_pool, gate_pool, entry_pool, qsl, seq,
                             table, slots, m.position_bias.data, m.kv_norm.weight.data,
                             m.rotary_emb.compress_inv_freq, rate, overlap,
                             m.kv_norm.variance_epsilon,
                             m.rotary_emb.compress_attention_scaling)
        for i in range(2):  # the rows of closing tokens carry their entries, others zeros
            for j in range(lens[i]):
                p = ctx[i] + j
                row = fresh[qsl[i] + j]
                if (p + 1) % rate == 0:
                    torch.testing.assert_close(row, want[i][(p + 1) // rate - 1], rtol=0,
                                               atol=1e-6)
                else:
                    assert torch.equal(row, torch.zeros_like(row))
        assert torch.equal(fresh[-2:], torch.zeros_like(fresh[-2:]))
    for i, slot in enumerate((1, 0)):
        got = _entries(entry_pool, steps.table[slot], totals[i] // rate)
        assert got.shape == want[i].shape
        torch.testing.assert_close(got, want[i], rtol=0, atol=1e-6)


def _indexer_entries(indexer, hidden):
    """The indexer's compressed keys over a whole sequence: what its scorer receives."""
    found = []
    hook = indexer.scorer.register_forward_hook(lambda mod, a, out: found.append(a[1]))
    try:
        t = hidden.shape[1]
        indexer(hidden, torch.zeros(1, t, 24), torch.arange(t)[None], None, 0)
    finally:
        hook.remove()
    return found[0][0]


def test_index_topk_matches_hf_indexer():
    config = _config()
    m = _module(hf.DeepseekV4CSACompressor, config).indexer
    rate, dim, k = m.compress_rate, m.head_dim, m.index_topk
    t = 19
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, t, 48, generator=gen)
    q_res = torch.randn(1, t, 24, generator=gen)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        want = m(hidden, q_res, pos, None, 0)[0]  # [T, k], -1: none
        cos, sin = m.rotary_emb(hidden, position_ids=pos, layer_type="compress")
        q = m.q_b_proj(q_res).view(1, t, -1, dim).transpose(1, 2)
        q = hf.apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]
        weights = m.scorer.weights_proj(hidden)[0].float() * m.scorer.weights_scaling
        kv, gate = m.kv_proj(hidden)[0], m.gate_proj(hidden)[0]
    kv_pool, gate_pool, entry_pool = _pools(2 * dim, 2 * dim, dim)
    table = torch.randperm(PAGES, generator=gen)[None].int()
    got = []
    for start, n in ((0, 7), (7, 1), (8, 5), (13, 6)):  # one request in four steps
        qsl, seq = torch.tensor([0, n]), torch.tensor([start + n])
        p = torch.arange(start, start + n)
        slots = table[0].long()[p // PAGE] * PAGE + p % PAGE
        fresh = OPS.compress(kv[start:start + n], gate[start:start + n], kv_pool, gate_pool,
                             entry_pool, qsl, seq, table, slots, m.position_bias.data,
                             m.kv_norm.weight.data, m.rotary_emb.compress_inv_freq, rate, True,
                             m.kv_norm.variance_epsilon, m.rotary_emb.compress_attention_scaling)
        got.append(OPS.index_topk(q[start:start + n], weights[start:start + n], entry_pool,
                                  fresh, qsl, seq, table, rate, k, m.scorer.softmax_scale))
    got = torch.cat(got)
    assert got.shape == (t, k) and got.dtype == torch.int64
    for row in range(t):
        mine = sorted(x for x in got[row].tolist() if x >= 0)
        theirs = sorted(x for x in want[row].tolist() if x >= 0)
        assert mine == theirs, row
        assert len(mine) == min(k, (row + 1) // rate)


def _naive(q, kv_rows, entries, context, window, rate, sinks, scale, picks=None):
    """One request's queries over its whole key sequence and entries as one masked softmax."""
    total = kv_rows.shape[0]
    out = []
    for j in range(q.shape[0]):
        p = context + j
        kpos = torch.arange(total)
        keep = (kpos <= p) & (kpos > p - window)
        seen = torch.zeros(entries.shape[0], dtype=torch.bool)
        if picks is None:
            seen[: (p + 1) // rate] = True
        else:
            seen[picks[j][picks[j] >= 0]] = True
        keys = torch.cat([kv_rows, entries])  # K = V
        mask = torch.cat([keep, seen])
        logits = (q[j] @ keys.T) * scale  # [H, S]
        logits = logits.masked_fill(~mask, float("-inf"))
        logits = torch.cat([logits, sinks[:, None]], dim=1)
        probs = logits.softmax(-1)[:, :-1]
        out.append(probs @ keys)
    return torch.stack(out)


@pytest.mark.parametrize("with_picks", [False, True], ids=["hca", "csa"])
def test_compressed_attention_matches_masked_softmax(with_picks):
    gen = torch.Generator().manual_seed(5)
    heads, dim, window, rate, scale = 4, 16, 3, 2, 0.3
    lens, ctx = [4, 0, 3], [9, 5, 0]
    n = sum(lens)
    k_pool, v_pool = _pools(dim, dim)
    k_pool, v_pool = k_pool.unsqueeze(2).contiguous(), v_pool.unsqueeze(2).contiguous()
    entry_pool, = _pools(dim)
    table = torch.randperm(PAGES, generator=gen)[:18].view(3, 6).int()
    rows, seq_kv, ent, picks = [], [], [], []
    for i in range(3):
        total = ctx[i] + lens[i]
        kv_all = torch.randn(total, dim, generator=gen)
        e = torch.randn(total // rate, dim, generator=gen)
        seq_kv.append(kv_all)
        ent.append(e)
        flat = k_pool.view(-1, 1, dim), v_pool.view(-1, 1, dim)
        pos = torch.arange(ctx[i])
        r = table[i].long()[pos // PAGE] * PAGE + pos % PAGE
        flat[0][r, 0], flat[1][r, 0] = kv_all[: ctx[i]], kv_all[: ctx[i]]
        w = torch.arange(e.shape[0])
        entry_pool.view(-1, dim)[table[i].long()[w // PAGE] * PAGE + w % PAGE] = e
        pos = torch.arange(ctx[i], total)
        rows.append(table[i].long()[pos // PAGE] * PAGE + pos % PAGE)
        p = []
        for j in range(lens[i]):
            seen = (ctx[i] + j + 1) // rate
            choice = torch.randperm(max(seen, 1), generator=gen)[: min(2, seen)]
            p.append(torch.cat([choice, torch.full((2 - choice.numel(),), -1)]))
        picks.append(torch.stack(p) if p else torch.empty(0, 2, dtype=torch.int64))
    q = torch.randn(n + 1, heads, dim, generator=gen)  # one padding row
    new = torch.cat([s[c:] for s, c in zip(seq_kv, ctx)] + [torch.full((1, dim), float("nan"))])
    qsl = torch.tensor([0, 4, 4, 7])
    seq = torch.tensor([c + n_ for c, n_ in zip(ctx, lens)])
    slots = torch.cat(rows + [torch.tensor([-1])])
    sinks = torch.randn(heads, generator=gen)
    topk = torch.cat(picks + [torch.full((1, 2), -1)]) if with_picks else None
    fresh = torch.zeros(n + 1, dim)
    got = OPS.compressed_attention(q, new[:, None], new[:, None], k_pool, v_pool, qsl, seq,
                                   table, slots, scale, window, 0.0, sinks, entry_pool, fresh,
                                   rate, topk)
    for i, (a, b) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        if a == b:
            continue
        want = _naive(q[a:b], seq_kv[i], ent[i], ctx[i], window, rate, sinks, scale,
                      picks[i] if with_picks else None)
        torch.testing.assert_close(got[a:b], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_dense_compress_is_the_ragged_op_on_a_uniform_layout():
    config = _config()
    m = _module(hf.DeepseekV4CSACompressor, config)
    gen = torch.Generator().manual_seed(6)
    kv = torch.randn(2, 5, 64, generator=gen)
    gate = torch.randn(2, 5, 64, generator=gen)
    table = torch.arange(8).view(2, 4).int()
    ctx = torch.tensor([3, 0], dtype=torch.int32)
    extra = (m.position_bias.data, m.kv_norm.weight.data, m.rotary_emb.compress_inv_freq, 2,
             True, 1e-6, 1.0)
    dense_pools = [torch.zeros(8, PAGE, w) for w in (64, 64, 32)]
    ragged_pools = [p.clone() for p in dense_pools]
    dense = OPS.dense_compress(kv, gate, *dense_pools, table, ctx, *extra)
    qsl, seq, slots = reference.dense_layout(2, 5, ctx, table, PAGE, "cpu")
    ragged = OPS.compress(kv.reshape(10, 64), gate.reshape(10, 64), *ragged_pools, qsl, seq,
                          table, slots, *extra)
    assert torch.equal(dense.reshape(10, 32), ragged)
    for a, b in zip(dense_pools, ragged_pools):
        assert torch.equal(a, b)


def _fake(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype)


@pytest.mark.parametrize("change, match", [
    ({"rate": 0}, "rate=0"),
    ({"kv_pool": (8, 4, 32)}, r"kv_pool is \(8, 4, 32\)"),
    ({"kv": (10, 48), "gate": (10, 48)}, "kv has 48 channels"),
    ({"gate": (10, 32)}, "gate"),
    ({"position_bias": (3, 64)}, r"position_bias is \(3, 64\)"),
    ({"norm_weight": (16,)}, "norm_weight"),
    ({"entry_pool": (8, 4, 16)}, "kv has 64 channels but the entry pool 16"),
    ({"inv_freq": (20,)}, "inv_freq"),
])
def test_compress_fake_refuses_by_name(change, match):
    shapes = dict(kv=(10, 64), gate=(10, 64), kv_pool=(8, 4, 64), gate_pool=(8, 4, 64),
                  entry_pool=(8, 4, 32), position_bias=(2, 64), norm_weight=(32,),
                  inv_freq=(4,))
    scalars = dict(rate=2, overlap=True)
    for k, v in change.items():
        (shapes if k in shapes else scalars)[k] = v
    with FakeTensorMode():
        t = {k: _fake(*v) for k, v in shapes.items()}
        with pytest.raises(ValueError, match=match):
            OPS.compress(t["kv"], t["gate"], t["kv_pool"], t["gate_pool"], t["entry_pool"],
                         _fake(3, dtype=torch.int32), _fake(2, dtype=torch.int32),
                         _fake(2, 4, dtype=torch.int32), _fake(10, dtype=torch.int64),
                         t["position_bias"], t["norm_weight"], t["inv_freq"],
                         scalars["rate"], scalars["overlap"], 1e-6, 1.0)


def test_index_and_attention_fakes_refuse_by_name():
    with FakeTensorMode():
        i32 = lambda *s: _fake(*s, dtype=torch.int32)  # noqa: E731
        q, w, pool, fresh = _fake(6, 8, 16), _fake(6, 8), _fake(8, 4, 16), _fake(6, 16)
        with pytest.raises(ValueError, match="topk=0"):
            OPS.index_topk(q, w, pool, fresh, i32(3), i32(2), i32(2, 4), 2, 0, 0.25)
        with pytest.raises(ValueError, match="weights"):
            OPS.index_topk(q, _fake(6, 4), pool, fresh, i32(3), i32(2), i32(2, 4), 2, 3, 0.25)
        with pytest.raises(ValueError, match="fresh"):
            OPS.index_topk(q, w, pool, _fake(6, 8), i32(3), i32(2), i32(2, 4), 2, 3, 0.25)
        qa, kv = _fake(6, 4, 32), _fake(6, 1, 32)
        caches = (_fake(8, 4, 1, 32), _fake(8, 4, 1, 32))
        args = (qa, kv, kv, *caches, i32(3), i32(2), i32(2, 4), _fake(6, dtype=torch.int64),
                0.2, 4, 0.0, None)
        with pytest.raises(ValueError, match="entries is"):
            OPS.compressed_attention(*args, _fake(8, 4, 16), _fake(6, 32), 4, None)
        with pytest.raises(ValueError, match="fresh is"):
            OPS.compressed_attention(*args, _fake(8, 4, 32), _fake(5, 32), 4, None)
        with pytest.raises(ValueError, match="topk is"):
            OPS.compressed_attention(*args, _fake(8, 4, 32), _fake(6, 32), 4, _fake(6, 3))
        with pytest.raises(ValueError, match="rate=0"):
            OPS.compressed_attention(*args, _fake(8, 4, 32), _fake(6, 32), 0, None)
