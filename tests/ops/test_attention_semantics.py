"""``dspark::ragged_attention``'s switches (window, softcap, sinks) and Dv != Dk: the reference
against a naive dense masked softmax and against transformers' own attention functions, its
containment, the dense op, the fakes and the argument checks."""

from __future__ import annotations

import pytest
import torch

import dspark_compile.ops  # noqa: F401  (registers the ops)
from attention_cases import make_case, naive_attention
from dspark_compile.ops import attention_reference as reference

OP = torch.ops.dspark.ragged_attention

# (lens, contexts, heads, kv_heads, dk, dv, page, padding rows): ragged lengths with an empty
# request and padding rows, GQA 1/2/4, Dv != Dk both ways.
LAYOUTS = {
    "gqa2": ([3, 0, 5, 1], [13, 4, 0, 9], 4, 2, 8, 8, 4, 2),
    "mla_dv_lt_dk": ([2, 4], [7, 11], 2, 2, 12, 8, 4, 1),
    "gqa4_dv_gt_dk": ([1, 6, 0], [20, 2, 5], 4, 1, 8, 16, 8, 0),
}
SWITCHES = {  # name -> (window, softcap, with sinks)
    "plain": (0, 0.0, False),
    "window_lt_context": (5, 0.0, False),
    "window_1": (1, 0.0, False),
    "window_beyond_all": (1000, 0.0, False),
    "softcap": (0, 2.0, False),
    "sinks": (0, 0.0, True),
    "window_softcap_sinks": (4, 1.5, True),
}


def _sinks(heads: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@pytest.mark.parametrize("switches", sorted(SWITCHES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_reference_matches_naive_dense(layout: str, switches: str) -> None:
    lens, contexts, h, hkv, dk, dv, page, pad = LAYOUTS[layout]
    window, softcap, with_sinks = SWITCHES[switches]
    case = make_case(lens, contexts, h, hkv, dk, dv, page, num_pad=pad, seed=len(switches))
    sinks = _sinks(h, 1) if with_sinks else None
    args = case.args()
    got = OP(*args, 0.3, window=window, softcap=softcap, sinks=sinks)
    assert got.shape == (case.q.shape[0], h, dv) and got.dtype == case.q.dtype
    want = naive_attention(case, 0.3, window, softcap, sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[case.num_real:], torch.zeros_like(got[case.num_real:]))
    flat_k, flat_v = args[3].flatten(0, 1), args[4].flatten(0, 1)
    real = case.slot_mapping[: case.num_real]
    assert torch.equal(flat_k[real], case.k[: case.num_real])  # the new K/V landed
    assert torch.equal(flat_v[real], case.v[: case.num_real])


@pytest.mark.parametrize("chunk, softcap, with_sinks", [
    (4, 0.0, False), (1, 0.0, False), (7, 1.5, True), (1000, 0.0, False)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunked_reference_matches_naive_dense(layout: str, chunk: int, softcap: float,
                                               with_sinks: bool) -> None:
    """Chunked attention (Llama 4): a query sees the keys of its own chunk up to itself;
    contexts and lengths cross chunk edges, chunk 1 is each query's own key, 1000 is causal."""
    lens, contexts, h, hkv, dk, dv, page, pad = LAYOUTS[layout]
    case = make_case(lens, contexts, h, hkv, dk, dv, page, num_pad=pad, seed=chunk)
    sinks = _sinks(h, 1) if with_sinks else None
    got = OP(*case.args(), 0.3, softcap=softcap, sinks=sinks, chunk=chunk)
    want = naive_attention(case, 0.3, softcap=softcap, sinks=sinks, chunk=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[case.num_real:], torch.zeros_like(got[case.num_real:]))
    if chunk == 1000:
        assert torch.equal(got, OP(*case.args(), 0.3, softcap=softcap, sinks=sinks))


def test_chunked_reads_only_its_chunk() -> None:
    """Pool positions below each request's first query's chunk are NaN: the output equals the
    clean run's. A NaN V in the first query's chunk reaches that chunk's rows only."""
    case = make_case([5, 3], [13, 6], 4, 2, 8, page=4, seed=6)
    clean = OP(*case.args(), 0.3, chunk=6)
    flat_v = case.v_cache.flatten(0, 1)
    for i, ctx in enumerate(case.contexts):
        first = ctx - ctx % 6
        rows = [int(case.block_table[i, p // 4]) * 4 + p % 4 for p in range(first)]
        flat_v[rows] = float("nan")
    torch.testing.assert_close(OP(*case.args(), 0.3, chunk=6), clean, atol=0, rtol=0)
    rows = [int(case.block_table[0, 12 // 4]) * 4 + 12 % 4]  # position 12: chunk 12..17
    flat_v[rows] = float("nan")
    got = OP(*case.args(), 0.3, chunk=6)
    assert torch.isnan(got[:5]).all() and torch.isfinite(got[5:]).all()  # rows 13..17


def test_window_beyond_every_position_is_plain_causal_bitwise() -> None:
    case = make_case([3, 2], [6, 1], 4, 2, 8, page=4, seed=3)
    plain = OP(*case.args(), 0.3)
    assert torch.equal(OP(*case.args(), 0.3, window=9), plain)  # 9 = longest sequence
    assert not torch.equal(OP(*case.args(), 0.3, window=8), plain)


def test_window_1_is_each_querys_own_value() -> None:
    """A window of 1 sees only the query's own key: the output is its own V (per group)."""
    case = make_case([3, 2], [6, 1], 4, 2, 8, 6, page=4, seed=4)
    got = OP(*case.args(), 0.3, window=1)
    torch.testing.assert_close(got, case.v.repeat_interleave(2, dim=1), atol=0, rtol=0)


def test_sinks_in_any_float_dtype_compute_in_fp32() -> None:
    case = make_case([2, 3], [5, 0], 4, 2, 8, page=4, seed=5)
    sinks = _sinks(4, 2, torch.bfloat16)
    got = OP(*case.args(), 0.3, sinks=sinks)
    want = naive_attention(case, 0.3, sinks=sinks.float())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    very_negative = OP(*case.args(), 0.3, sinks=torch.full((4,), -1e4))
    torch.testing.assert_close(very_negative, OP(*case.args(), 0.3), atol=0, rtol=0)


@pytest.mark.parametrize("window", [3, 6])
def test_window_reads_only_its_pages_and_keys(window: int) -> None:
    """Pool positions below a request's first window are NaN and their pages are named by
    block-table entries no pool has (a sliding-window engine may have freed them): nothing
    raises and the output equals the clean run's. A NaN V inside the first query's window but
    outside the next one's reaches the first query only."""
    lens, contexts, page = [3, 2, 1], [13, 9, 4], 4
    case = make_case(lens, contexts, 4, 2, 8, 8, page, num_pad=1, seed=6)
    clean = OP(*case.args(), 0.3, window=window, softcap=2.0)
    num_pages = case.k_cache.shape[0]
    for i, ctx in enumerate(contexts):
        first = max(0, ctx - window + 1)  # lowest position any of request i's queries sees
        for pos in range(first):
            p = int(case.block_table[i, pos // page])
            case.k_cache[p, pos % page] = float("nan")
            case.v_cache[p, pos % page] = float("nan")
        case.block_table[i, : first // page] = num_pages + 1000  # would raise if indexed
    got = OP(*case.args(), 0.3, window=window, softcap=2.0)
    assert torch.equal(got, clean)
    # request 0: position 13 - window + 1 is in row 0's window only
    pos = contexts[0] - window + 1
    case.v_cache[int(case.block_table[0, pos // page]), pos % page] = float("nan")
    got = OP(*case.args(), 0.3, window=window, softcap=2.0)
    assert got[0].isnan().all() and torch.equal(got[1:], clean[1:])


def test_dense_op_equals_ragged_op_with_switches_and_dv() -> None:
    bs, t, h, hkv, dk, dv = 2, 3, 4, 2, 8, 6
    case = make_case([t] * bs, [2, 7], h, hkv, dk, dv, page=4, seed=8)
    sinks = _sinks(h, 3)
    kw = dict(window=4, softcap=3.0, sinks=sinks)
    args = case.args()
    ragged = OP(*args, 0.3, **kw)
    dense_args = case.args()
    dense = torch.ops.dspark.dense_cached_attention(
        case.q.view(bs, t, h, dk).transpose(1, 2), case.k.view(bs, t, hkv, dk).transpose(1, 2),
        case.v.view(bs, t, hkv, dv).transpose(1, 2), dense_args[3], dense_args[4],
        case.block_table, torch.tensor([2, 7], dtype=torch.int32), 0.3, **kw)
    assert dense.shape == (bs, t, h, dv)
    assert torch.equal(dense.reshape(bs * t, h, dv), ragged)
    assert torch.equal(dense_args[3], args[3]) and torch.equal(dense_args[4], args[4])


def test_opcheck_with_switches_and_dv() -> None:
    case = make_case([3, 1], [2, 5], 4, 2, 8, 6, page=4, seed=9)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(OP.default, (*case.args(), 0.3),
                          {"window": 3, "softcap": 1.5, "sinks": _sinks(4, 4)}, test_utils=utils)
    bs, t = 2, 2
    case = make_case([t] * bs, [3, 1], 4, 2, 8, 6, page=4, seed=10)
    dense = (case.q.view(bs, t, 4, 8).transpose(1, 2).contiguous(),
             case.k.view(bs, t, 2, 8).transpose(1, 2).contiguous(),
             case.v.view(bs, t, 2, 6).transpose(1, 2).contiguous(),
             case.k_cache, case.v_cache, case.block_table,
             torch.tensor([3, 1], dtype=torch.int32), 0.3)
    torch.library.opcheck(torch.ops.dspark.dense_cached_attention.default, dense,
                          {"window": 2, "softcap": 0.0, "sinks": _sinks(4, 5)},
                          test_utils=utils)


BAD = [  # (switches, message of the reference's ValueError)
    ({"window": -1}, "window=-1; it must be an int >= 0"),
    ({"chunk": -4}, "chunk=-4; it must be an int >= 0"),
    ({"chunk": 4, "window": 2}, "window=2 and chunk=4; at most one may be set"),
    ({"window": 2.0}, "window=2.0"),
    ({"window": True}, "window=True"),
    ({"softcap": -0.5}, "softcap=-0.5; it must be a finite float >= 0"),
    ({"softcap": float("inf")}, "softcap=inf"),
    ({"softcap": float("nan")}, "softcap=nan"),
    ({"sinks": torch.zeros(3)}, r"sinks is torch.float32 of shape \(3,\); .* \[H\] = \[4\]"),
    ({"sinks": torch.zeros(4, dtype=torch.int32)}, "sinks is torch.int32"),
]


@pytest.mark.parametrize("kw, match", BAD)
def test_bad_switches_raise_value_error_eager_and_traced(kw: dict, match: str) -> None:
    """The reference and the fake (what tracing runs) refuse alike, naming the argument. The
    op's schema converts before either runs: a float window is the dispatcher's error (naming
    ``window``), a bool is taken as the int it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case([2, 1], [3, 0], 4, 2, 8, page=4)
    with pytest.raises(ValueError, match=match):
        reference.ragged_attention(*case.args(), 0.3, **kw)
    if isinstance(kw.get("window"), bool):
        return
    error, match = ((RuntimeError, "for argument 'window'") if isinstance(kw.get("window"), float)
                    else (ValueError, match))
    args = case.args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        kw = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
              for k, v in kw.items()}
        with pytest.raises(error, match=match):
            OP(*fake, 0.3, **kw)


def _hf_mask(t: int, window: int) -> torch.Tensor:
    """transformers' own mask functions, evaluated per (q, kv): additive ``[1, 1, T, T]``."""
    from transformers import masking_utils as mu

    fn = (mu.sliding_window_causal_mask_function(window) if window
          else mu.causal_mask_function)
    keep = torch.tensor([[bool(fn(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(t)]
                         for i in range(t)])
    return torch.zeros(t, t).masked_fill(~keep, float("-inf"))[None, None]


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_matches_transformers_attention_functions(family: str) -> None:
    """One request with its first ``ctx`` tokens in the pool and the rest new, against the
    model family's own ``eager_attention_forward`` over the whole sequence with transformers'
    own sliding-window mask: Gemma 2's softcap, GPT-OSS's sinks (``module.sinks``)."""
    import importlib
    from types import SimpleNamespace

    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    ctx, length, h, hkv, d, window, scale = 9, 4, 4, 2, 8, 5, 0.35
    case = make_case([length], [ctx], h, hkv, d, page=4, seed=11)
    page = case.k_cache.shape[1]
    rows = [int(case.block_table[0, p // page]) * page + p % page for p in range(ctx)]
    k_all = torch.cat([case.k_cache.flatten(0, 1)[rows], case.k])  # [T, Hkv, D]
    v_all = torch.cat([case.v_cache.flatten(0, 1)[rows], case.v])
    q_all = torch.cat([torch.randn(ctx, h, d), case.q])  # earlier queries: HF computes them
    module = SimpleNamespace(num_key_value_groups=h // hkv, training=False, head_dim=d,
                             sinks=_sinks(h, 6))
    mask = _hf_mask(ctx + length, window)
    qkv = [x.transpose(0, 1)[None] for x in (q_all, k_all, v_all)]  # [1, heads, T, D]
    if family == "gemma2":
        want, _ = hf.eager_attention_forward(module, *qkv, mask, scaling=scale, softcap=2.5)
        kw = dict(window=window, softcap=2.5)
    else:
        want, _ = hf.eager_attention_forward(module, *qkv, mask, scaling=scale)
        kw = dict(window=window, sinks=module.sinks)
    got = OP(*case.args(), scale, **kw)
    torch.testing.assert_close(got, want[0, ctx:], atol=1e-5, rtol=1e-5)


def _rel(case, extent: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, h = case.q.shape[:2]
    return (torch.randn(n, h, extent, generator=g) * 2).to(dtype)


@pytest.mark.parametrize("extent, window, with_sinks", [
    (1, 0, False), (3, 0, False), (6, 5, True), (40, 0, True), (40, 4, False)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_relative_logits_reference_matches_naive_dense(layout: str, extent: int, window: int,
                                                       with_sinks: bool) -> None:
    """Relative logits (Inkling): a query adds its own logit of each key's distance below the
    extent, nothing past it; extents below and past the contexts, with windows and sinks."""
    lens, contexts, h, hkv, dk, dv, page, pad = LAYOUTS[layout]
    case = make_case(lens, contexts, h, hkv, dk, dv, page, num_pad=pad, seed=extent)
    rel = _rel(case, extent, window)
    sinks = _sinks(h, 1) if with_sinks else None
    got = OP(*case.args(), 0.3, window=window, sinks=sinks, rel=rel)
    want = naive_attention(case, 0.3, window, sinks=sinks, rel=rel)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[case.num_real:], torch.zeros_like(got[case.num_real:]))
    assert not torch.allclose(got[: case.num_real], OP(*case.args(), 0.3, window=window,
                                                       sinks=sinks)[: case.num_real])


def test_relative_logits_in_bf16_compute_in_fp32() -> None:
    case = make_case([3, 2], [9, 4], 4, 2, 8, page=4, seed=12)
    rel = _rel(case, 5, 2)
    got = OP(*case.args(), 0.3, rel=rel.to(torch.bfloat16))
    want = OP(*case.args(), 0.3, rel=rel.to(torch.bfloat16).float())
    assert torch.equal(got, want)


def test_dense_op_with_relative_logits_equals_ragged_op() -> None:
    """rel ``[bs, H, T, E]`` (the layout HF's position bias comes in) to the ragged rows."""
    bs, t, h, hkv, d = 2, 3, 4, 2, 8
    case = make_case([t] * bs, [2, 7], h, hkv, d, page=4, seed=8)
    rel = _rel(case, 4, 3)  # [N, H, E]
    ragged = OP(*case.args(), 0.3, window=3, rel=rel)
    args = case.args()
    dense = torch.ops.dspark.dense_cached_attention(
        case.q.view(bs, t, h, d).transpose(1, 2), case.k.view(bs, t, hkv, d).transpose(1, 2),
        case.v.view(bs, t, hkv, d).transpose(1, 2), args[3], args[4], case.block_table,
        torch.tensor([2, 7], dtype=torch.int32), 0.3, 3, 0.0, None, 0,
        rel.view(bs, t, h, 4).transpose(1, 2))
    assert torch.equal(dense.reshape(bs * t, h, d), ragged)


@pytest.mark.parametrize("bad, match", [
    ("rank", r"rel is torch.float32 of shape \(\d+, 4\); it must be None or a float tensor "
             r"\[\d+, 4, E\]"),
    ("heads", r"rel is torch.float32 of shape \(\d+, 3, 2\)"),
    ("empty", r"rel is torch.float32 of shape \(\d+, 4, 0\); .* E >= 1"),
    ("int", r"rel is torch.int32"),
    ("stride", r"rel has stride 2 in its last dim"),
    ("softcap", r"rel with softcap=1.5; a relative bias is defined without a logit softcap"),
])
def test_bad_relative_logits_raise_value_error_eager_and_traced(bad: str, match: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case([2, 1], [3, 0], 4, 2, 8, page=4)
    n = case.q.shape[0]
    rel, kw = {
        "rank": (torch.zeros(n, 4), {}), "heads": (torch.zeros(n, 3, 2), {}),
        "empty": (torch.zeros(n, 4, 0), {}), "int": (torch.zeros(n, 4, 2, dtype=torch.int32), {}),
        "stride": (torch.zeros(n, 4, 4)[..., ::2], {}),
        "softcap": (torch.zeros(n, 4, 2), {"softcap": 1.5})}[bad]
    with pytest.raises(ValueError, match=match):
        reference.ragged_attention(*case.args(), 0.3, rel=rel, **kw)
    args = case.args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        with pytest.raises(ValueError, match=match):
            OP(*fake, 0.3, rel=mode.from_tensor(rel), **kw)


@pytest.mark.parametrize("window, extent", [(0, 0), (4, 0), (5, 5), (0, 40)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_row_sinks_reference_matches_naive_dense(layout: str, window: int, extent: int) -> None:
    """Sinks ``[N, H]`` (Inkling 2: one logit per query row and head), alone and with windows
    and relative logits."""
    lens, contexts, h, hkv, dk, dv, page, pad = LAYOUTS[layout]
    case = make_case(lens, contexts, h, hkv, dk, dv, page, num_pad=pad, seed=window + extent)
    n = case.q.shape[0]
    sinks = torch.randn(n, h, generator=torch.Generator().manual_seed(7)) * 2
    rel = _rel(case, extent, 3) if extent else None
    got = OP(*case.args(), 0.3, window=window, sinks=sinks, rel=rel)
    torch.testing.assert_close(got, naive_attention(case, 0.3, window, sinks=sinks, rel=rel),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(got[case.num_real:], torch.zeros_like(got[case.num_real:]))
    per_head = OP(*case.args(), 0.3, window=window, sinks=sinks[0], rel=rel)
    assert not torch.allclose(got[1: case.num_real], per_head[1: case.num_real])


def test_dense_op_with_row_sinks_equals_ragged_op() -> None:
    bs, t, h, hkv, d = 2, 3, 4, 2, 8
    case = make_case([t] * bs, [2, 7], h, hkv, d, page=4, seed=8)
    sinks = torch.randn(bs * t, h, generator=torch.Generator().manual_seed(1))
    ragged = OP(*case.args(), 0.3, sinks=sinks)
    args = case.args()
    dense = torch.ops.dspark.dense_cached_attention(
        case.q.view(bs, t, h, d).transpose(1, 2), case.k.view(bs, t, hkv, d).transpose(1, 2),
        case.v.view(bs, t, hkv, d).transpose(1, 2), args[3], args[4], case.block_table,
        torch.tensor([2, 7], dtype=torch.int32), 0.3, 0, 0.0,
        sinks.view(bs, t, h).transpose(1, 2))
    assert torch.equal(dense.reshape(bs * t, h, d), ragged)


def test_row_sinks_of_another_shape_are_refused() -> None:
    case = make_case([2, 1], [3, 0], 4, 2, 8, page=4)
    n = case.q.shape[0]
    with pytest.raises(ValueError, match=r"sinks is torch.float32 of shape \(\d+, 3\); .* or "
                                         r"\[\d+, 4\] \(one logit per query row and head\)"):
        OP(*case.args(), 0.3, sinks=torch.zeros(n, 3))
    with pytest.raises(ValueError, match=r"dspark::sparse_attention|sparse_attention: sinks is"):
        from dspark_compile.ops.attention_reference import check_semantics
        check_semantics("sparse_attention", 0, 0.0, torch.zeros(n, 4), 4)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_alibi_reference_matches_naive_dense(layout: str, window: int) -> None:
    """ALiBi: a head's slope times ``kpos - qpos`` added to its scores (BLOOM adds slope *
    kpos: a constant a row away, the same softmax)."""
    lens, contexts, h, hkv, dk, dv, page, pad = LAYOUTS[layout]
    case = make_case(lens, contexts, h, hkv, dk, dv, page, num_pad=pad, seed=window + 4)
    slopes = 2.0 ** -torch.arange(1, h + 1, dtype=torch.float32)
    got = OP(*case.args(), 0.3, window=window, alibi=slopes)
    want = naive_attention(case, 0.3, window, alibi=slopes)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[: case.num_real],
                              OP(*case.args(), 0.3, window=window)[: case.num_real])


def test_bad_alibi_is_refused() -> None:
    case = make_case([2, 1], [3, 0], 4, 2, 8, page=4)
    with pytest.raises(ValueError, match=r"alibi is torch.float32 of shape \(3,\); it must be "
                                         r"None or a float tensor \[H\] = \[4\]"):
        OP(*case.args(), 0.3, alibi=torch.zeros(3))
    with pytest.raises(ValueError, match=r"alibi with softcap=1.0"):
        OP(*case.args(), 0.3, softcap=1.0, alibi=torch.zeros(4))
