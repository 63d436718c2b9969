"""The Triton attention's switches (window, softcap, sinks) and Dv != Dk against the reference:
tiny shapes under the interpreter (16-key tiles, so short contexts span several), split and
not; ``-m gpu``: bf16 at real shapes on the accelerator.

Each interpreted launch costs seconds on the CPU, so the CPU cases are few and small.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from attention_cases import make_case
from dspark_compile.kernels.attention import plan_attention, ragged_attention_triton
from dspark_compile.kernels.targets import TARGETS
from dspark_compile.ops import attention_reference as reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
needs_kernel_device = pytest.mark.skipif(
    not INTERPRET and not HAS_CUDA,
    reason="needs TRITON_INTERPRET=1 (set before import, as `make test` does) or a GPU")
gpu_only = pytest.mark.skipif(INTERPRET or not HAS_CUDA, reason="needs a GPU, no interpreter")
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = (1e-5, 1e-5) if INTERPRET else (3e-3, 3e-3)  # fp32 (atol, rtol); CUDA: cuBLAS vs ours
SMALL_TILES = dataclasses.replace(TARGETS["sm_90"], attn_tile_n=16)
"""16-key context tiles: a 50-key context is 4 tiles, so windows skip and band tiles."""

SWITCHES = {  # name -> (Dv, window, softcap, sinks)
    "window": (16, 12, 0.0, False),
    "softcap": (16, 0, 3.0, False),
    "sinks": (16, 0, 0.0, True),
    "mla_dv8": (8, 0, 0.0, False),
    "all_dv32": (32, 9, 2.0, True),
}


@needs_kernel_device
def test_slopes_that_are_a_strided_view_match_reference() -> None:
    """Bloom hands its slopes over as a column of its ALiBi tensor (a view of stride 2): the
    kernel reads head ``h`` at offset ``h``, so the op makes such a view dense first (the
    reference indexes it as a tensor). Without that, Bloom verified wrong on a GPU."""
    case = make_case([3, 0, 5, 1], [37, 5, 50, 0], 4, 4, 16, 16, page=8, num_pad=2, seed=9,
                     device=DEVICE)
    table = torch.tensor([[0.0, 0.5], [0.0, 0.125], [0.0, 1 / 32], [0.0, 1 / 128]]).to(DEVICE)
    alibi = table[:, 1]
    assert alibi.stride(0) == 2
    for num_splits in (1, 3):
        _check(*run_both(case, 0, 0.0, _sinks(4), alibi=alibi, num_splits=num_splits,
                         max_query_len=5, config=SMALL_TILES), case.num_real)


def _sinks(heads: int, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(heads)
    return (torch.randn(heads, generator=g) * 2).to(dtype).to(device)


def run_both(case, window=0, softcap=0.0, sinks=None, scale=0.3, chunk=0, rel=None, alibi=None,
             **kw):
    """(triton output, triton pools, reference output, reference pools); the output buffer
    starts as NaN so a row the kernel forgets cannot pass."""
    got_args, ref_args = case.args(), case.args()
    out = torch.full((case.q.shape[0], case.q.shape[1], case.v.shape[2]), float("nan"),
                     dtype=case.q.dtype, device=case.q.device)
    got = ragged_attention_triton(*got_args, scale, window, softcap, sinks, out=out,
                                  chunk=chunk, rel=rel, alibi=alibi, **kw)
    assert got is out
    ref = reference.ragged_attention(*ref_args, scale, window, softcap, sinks, chunk, rel,
                                     alibi)
    return got, got_args[3:5], ref, ref_args[3:5]


def _check(got, got_pools, ref, ref_pools, num_real, tol=TOL) -> None:
    torch.testing.assert_close(got, ref, atol=tol[0], rtol=tol[1])
    assert torch.equal(got[num_real:], torch.zeros_like(got[num_real:])), "padding rows"
    for g, r in zip(got_pools, ref_pools):
        assert torch.equal(g, r), "KV pool after the write differs from the reference's"


@needs_kernel_device
@pytest.mark.parametrize("num_splits,fold", [(1, True), (3, True)])
@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_switch_matches_reference(name: str, num_splits: int, fold: bool) -> None:
    """GQA 2, an empty request, padding rows, contexts across 16-key tiles; unsplit and split
    with the merge folded into the launch (sinks must count once over the splits)."""
    dv, window, softcap, with_sinks = SWITCHES[name]
    case = make_case([3, 0, 5, 1], [37, 5, 50, 0], 4, 2, 16, dv, page=8, num_pad=2,
                     seed=len(name), device=DEVICE)
    sinks = _sinks(4) if with_sinks else None
    _check(*run_both(case, window, softcap, sinks, num_splits=num_splits, max_query_len=5,
                     fold_reduce=fold, config=SMALL_TILES), case.num_real)


@needs_kernel_device
@pytest.mark.parametrize("num_splits,fold", [(1, True), (3, True), (4, False)])
@pytest.mark.parametrize("chunk", [5, 16, 24])
def test_chunks_match_reference(chunk: int, num_splits: int, fold: bool) -> None:
    """Chunked attention: q-blocks whose rows straddle a chunk edge (per-row first keys: the
    band), chunks below a tile, of one tile and across tiles, contexts across 16-key tiles,
    with softcap and sinks on, split with the merge folded or in a reduce launch."""
    case = make_case([3, 0, 7, 1], [37, 5, 45, 0], 4, 2, 16, 16, page=8, num_pad=2,
                     seed=chunk, device=DEVICE)
    _check(*run_both(case, 0, 1.5, _sinks(4), chunk=chunk, num_splits=num_splits,
                     max_query_len=8, fold_reduce=fold, config=SMALL_TILES), case.num_real)


@needs_kernel_device
@pytest.mark.parametrize("hint", [None, 1])
def test_chunks_over_a_prefill(hint) -> None:
    """A 30-token prefill after 20 keys in chunks of 8: new-key tiles below a later block's
    chunk are skipped, every block crosses chunk edges."""
    case = make_case([30, 2], [20, 3], 2, 1, 16, 16, page=8, num_pad=1, seed=5, device=DEVICE)
    _check(*run_both(case, chunk=8, num_splits=2, max_query_len=hint, fold_reduce=True,
                     config=SMALL_TILES), case.num_real)


@needs_kernel_device
@pytest.mark.parametrize("hint,num_splits", [(None, 1), (1, 4)])
def test_window_over_a_prefill_skips_tiles_and_bands(hint, num_splits: int) -> None:
    """A 26-token prefill after 20 keys, window 6 (< the query block): band tiles span two
    key tiles; with a hint of 1 (8-query blocks) later blocks skip the new-key tiles below
    their window; with a reduce launch merging the splits, sinks and softcap on."""
    case = make_case([26, 2], [20, 3], 2, 1, 16, 16, page=8, num_pad=1, seed=3, device=DEVICE)
    _check(*run_both(case, 6, 1.5, _sinks(2), num_splits=num_splits, max_query_len=hint,
                     fold_reduce=False, config=SMALL_TILES), case.num_real)


@needs_kernel_device
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_window_keeps_what_lies_below_it_out(num_splits: int) -> None:
    """NaN K and Inf V at every pool position below each request's first window, and the
    block-table entries of pages wholly below it pointing at a page full of NaN: the output
    equals the clean run's. NaN V in request 0's band (keys its first rows see and its last
    do not; in the split's first tile and in the band loop's) reaches only the rows that see
    it, as in the reference."""
    lens, contexts, window, page = [5, 2, 1], [55, 30, 9], 10, 8  # request 0: keys from 46
    case = make_case(lens, contexts, 4, 2, 16, 16, page, num_pad=1, seed=5, device=DEVICE)
    kw = dict(num_splits=num_splits, max_query_len=5, config=SMALL_TILES)
    clean, _, _, _ = run_both(case, window, **kw)
    owned = set(case.block_table.flatten().tolist())
    poison_page = min(set(range(case.k_cache.shape[0])) - owned)  # a page no request owns
    case.k_cache[poison_page] = float("nan")
    case.v_cache[poison_page] = float("nan")
    for i, ctx in enumerate(contexts):
        first = max(0, ctx - window + 1)
        for pos in range(first):
            p = int(case.block_table[i, pos // page])
            case.k_cache[p, pos % page] = float("nan")
            case.v_cache[p, pos % page] = float("inf")
        case.block_table[i, : first // page] = poison_page
    got, _, ref, _ = run_both(case, window, **kw)
    torch.testing.assert_close(got, clean, atol=TOL[0], rtol=TOL[1])
    for pos, seen_by in ((47, 2), (48, 3)):  # 16-key tiles: 47 in tile 2, 48 in tile 3
        case.v_cache[int(case.block_table[0, pos // page]), pos % page, :, 2:5] = float("nan")
        got, _, ref, _ = run_both(case, window, **kw)
        assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "non-finite where visible"
        assert (~torch.isfinite(got[:seen_by])).flatten(1).any(1).all()
        assert torch.isfinite(got[seen_by:]).all(), f"key {pos} reached a row past its window"
        fin = torch.isfinite(ref)
        torch.testing.assert_close(got[fin], ref[fin], atol=TOL[0], rtol=TOL[1])


_WILD_PAGES = """
import torch
from attention_cases import make_case
from dspark_compile.kernels.targets import TARGETS
from dspark_compile.kernels.attention import ragged_attention_triton
from dspark_compile.ops import attention_reference as reference
import dataclasses
cfg = dataclasses.replace(TARGETS["sm_90"], attn_tile_n=16)
case = make_case([5, 2], [55, 30], 4, 2, 16, 16, 8, num_pad=1, seed=5)
want = reference.ragged_attention(*case.args(), 0.3, 10)
for i, ctx in enumerate(case.contexts):
    case.block_table[i, : (ctx - 10 + 1) // 8] = 2 ** 30  # far past the pool: a read faults
for splits in (1, 3):
    got = ragged_attention_triton(*case.args(), 0.3, 10, num_splits=splits, max_query_len=5,
                                  config=cfg)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
print("ok")
"""


@pytest.mark.skipif(not INTERPRET, reason="the GPU test below does this on the device")
def test_window_never_reads_page_ids_below_it() -> None:
    """Block-table entries of pages wholly below every window name a page 2**30 pages past
    the pool: the windowed launch (split and not) never loads them, or the interpreter would
    fault. Run in a child process, so that a fault fails this test and not the session."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _WILD_PAGES], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        f"rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@needs_kernel_device
def test_bf16_sinks_on_fp32_activations() -> None:
    """Sinks in another float dtype than q are read as they are (no host-side cast)."""
    case = make_case([2, 4], [19, 0], 4, 2, 16, page=8, seed=9, device=DEVICE)
    sinks = _sinks(4, dtype=torch.bfloat16)
    _check(*run_both(case, sinks=sinks, max_query_len=4, config=SMALL_TILES), case.num_real)


def test_split_rule_counts_only_the_keys_a_window_reads() -> None:
    cfg = TARGETS["sm_90"]
    full_1k = plan_attention(8, 1, 16, 8, 1040, 8, cfg, 132)
    window_8k = plan_attention(8, 1, 16, 8, 8200, 8, cfg, 132, window=1024)
    assert window_8k == full_1k, "window 1024 at 8k context plans like a 1k context"
    assert plan_attention(8, 1, 16, 8, 8200, 8, cfg, 132).num_splits > full_1k.num_splits
    assert plan_attention(8, 1, 16, 8, 8200, 8, cfg, 132, window=40).num_splits == 1


def test_head_dims_past_128_lift_the_register_cap() -> None:
    """A 16-row tile keeps the target's register cap up to head dim 128 (the plain build's
    launch), and drops it past (MLA's 192, Gemma's 256 spilled under it)."""
    cfg = TARGETS["sm_90"]
    assert plan_attention(8, 1, 16, 8, 1040, 8, cfg, 132).max_registers == 128
    assert plan_attention(8, 1, 16, 8, 1040, 8, cfg, 132, head_dim_pad=128).max_registers == 128
    assert plan_attention(8, 1, 16, 8, 1040, 8, cfg, 132, head_dim_pad=256).max_registers is None


BAD = [  # (what to change, message)
    (dict(window=-2), "window=-2; it must be an int >= 0"),
    (dict(window=3.0), "window=3.0"),
    (dict(softcap=-1.0), "softcap=-1.0; it must be a finite float >= 0"),
    (dict(softcap=float("inf")), "softcap=inf"),
    (dict(sinks="3 heads"), r"sinks is torch.float32 of shape \(3,\)"),
    (dict(sinks="int"), "sinks is torch.int64"),
    (dict(sinks="strided"), "sinks has stride 2"),
    (dict(sinks="meta"), "sinks is on meta but q is on"),
    (dict(v="dv"), r"v_cache \(\d+, 8, 2, 16\) .* v's head dim 8"),
    (dict(out="dk"), r"out \(4, 4, 16\) .* v's head dim 8"),
]


@pytest.mark.parametrize("change, match", BAD)
def test_bad_switches_are_refused_before_launch(change: dict, match: str) -> None:
    case = make_case([3, 1], [4, 0], 4, 2, 16, 8, page=8, device=DEVICE)
    kw = {"window": 0, "softcap": 0.0, "sinks": None, "out": None}
    kw.update({k: v for k, v in change.items() if k in ("window", "softcap")})
    sinks = change.get("sinks")
    kw["sinks"] = {None: None, "3 heads": _sinks(3), "int": torch.zeros(4, dtype=torch.long),
                   "strided": _sinks(8)[::2], "meta": torch.zeros(4, device="meta")}[sinks]
    args = case.args()
    if change.get("v") == "dv":  # V pool with K's head dim while v has 8
        args[4] = torch.zeros_like(args[3])
    if change.get("out") == "dk":
        kw["out"] = torch.empty_like(case.q)
    with pytest.raises(ValueError, match=match):
        ragged_attention_triton(*args, 0.3, **kw)


def test_lowering_moves_the_switches_to_keywords() -> None:
    """A reference call with window/softcap/sinks given positionally lowers to the Triton op
    with the block and early-reads flag after the ten leading arguments and the switches as
    keywords."""
    from types import SimpleNamespace

    import torch.fx as fx

    from dspark_compile.passes import lower

    g = fx.Graph()
    names = ("q", "k", "v", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_table",
             "slot_mapping", "sinks")
    p = {n: g.placeholder(n) for n in names}
    node = g.call_function(torch.ops.dspark.ragged_attention.default,
                           (*[p[n] for n in names[:9]], 0.5, 7, 2.5, p["sinks"]))
    g.output(node)
    gm = fx.GraphModule(torch.nn.Module(), g)
    ctx = SimpleNamespace(settings=SimpleNamespace(lowering="triton", block=8))
    assert lower.run(gm, ctx).changed == 1
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert call.target is torch.ops.dspark.ragged_attention_triton.default
    assert call.args[9:] == (0.5, 8, False)
    assert call.kwargs == {"window": 7, "softcap": 2.5, "sinks": p["sinks"]}


# ---- GPU (bf16, real shapes): `pytest -m gpu tests/kernels/test_triton_attention_semantics.py`

GPU_SWITCHES = {  # name -> (heads, kv heads, Dk, Dv, window, softcap, sinks)
    "window1024": (16, 8, 128, 128, 1024, 0.0, False),
    "softcap50": (16, 8, 128, 128, 0, 50.0, False),
    "sinks": (64, 8, 64, 64, 0, 0.0, True),
    "gpt_oss_window128_sinks": (64, 8, 64, 64, 128, 0.0, True),
    "gemma2_window4096_softcap": (16, 8, 256, 256, 4096, 50.0, False),
    "mla_192_128": (16, 16, 192, 128, 0, 0.0, False),
}


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("bs,context", [(1, 8192), (8, 2048), (64, 1024)])
@pytest.mark.parametrize("name", sorted(GPU_SWITCHES))
def test_gpu_bf16_switches(name: str, bs: int, context: int) -> None:
    """Mixed verify widths 1..8, page 16, padding rows; bs 1/8 split (folded), bs 64 not."""
    h, hkv, dk, dv, window, softcap, with_sinks = GPU_SWITCHES[name]
    g = torch.Generator().manual_seed(bs)
    lens = torch.randint(1, 9, (bs,), generator=g).tolist()
    case = make_case(lens, [context] * bs, h, hkv, dk, dv, page=16, num_pad=5, seed=bs,
                     dtype=torch.bfloat16, device="cuda")
    sinks = _sinks(h, "cuda", torch.bfloat16) if with_sinks else None
    _check(*run_both(case, window, softcap, sinks, scale=dk ** -0.5, max_query_len=8),
           case.num_real, tol=(2e-2, 2e-2))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("num_splits,fold", [(1, True), (4, True), (4, False)])
def test_gpu_bf16_window_prefill_with_splits(num_splits: int, fold: bool) -> None:
    """A 300-token prefill after 2000 keys, window 256: bands over several tiles, new-key
    tiles skipped, splits merged in the launch or by the reduce, with sinks and softcap."""
    case = make_case([300, 5, 1], [2000, 700, 0], 64, 8, 64, 64, page=16, num_pad=3, seed=2,
                     dtype=torch.bfloat16, device="cuda")
    _check(*run_both(case, 256, 30.0, _sinks(64, "cuda"), scale=0.125, num_splits=num_splits,
                     max_query_len=300, fold_reduce=fold), case.num_real, tol=(2e-2, 2e-2))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("bs", [1, 64])
def test_gpu_window_reads_only_its_pages(bs: int) -> None:
    """Window 1024 at context 8192: the block-table entries of pages wholly below every
    window name a page 2**30 pages past the pool (a read there is an illegal address), and
    the output matches the reference run on the intact table."""
    lens = torch.randint(1, 9, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
    case = make_case(lens, [8192] * bs, 16, 8, 128, 128, page=16, num_pad=2, seed=bs,
                     dtype=torch.bfloat16, device="cuda")
    want = reference.ragged_attention(*case.args(), 128 ** -0.5, 1024)
    case.block_table[:, : (8192 - 1024 + 1) // 16] = 2 ** 30
    got = ragged_attention_triton(*case.args(), 128 ** -0.5, 1024, max_query_len=8)
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_kernel_device
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(0, 12), min_size=1, max_size=4),
       contexts=st.lists(st.integers(0, 60), min_size=4, max_size=4),
       chunk=st.integers(1, 40), hint=st.sampled_from([None, 1, 4, 8]),
       num_splits=st.sampled_from([1, 2, 3]), fold=st.booleans())
def test_random_chunked_layouts_match_reference(lens, contexts, chunk, hint, num_splits, fold):
    """Random ragged layouts against the reference: chunk edges anywhere relative to the
    16-key tiles, the q-blocks (``max_query_len``) and the splits."""
    case = make_case(lens, contexts[:len(lens)], 2, 1, 16, 16, page=8, num_pad=1,
                     seed=chunk, device=DEVICE)
    _check(*run_both(case, chunk=chunk, num_splits=num_splits, max_query_len=hint,
                     fold_reduce=fold, config=SMALL_TILES), case.num_real)


def _rel(case, extent: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(extent)
    n, h = case.q.shape[:2]
    return (torch.randn(n, h, extent, generator=g) * 2).to(dtype).to(case.q.device)


@needs_kernel_device
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("extent,window", [(3, 0), (20, 0), (70, 0), (12, 12), (5, 12)])
def test_relative_logits_match_reference(extent: int, window: int, num_splits: int) -> None:
    """Relative logits: extents inside the new keys, across context tiles and past every
    context, under a window as wide as the extent (Inkling's sliding layers) and wider; sinks
    on; unsplit and split (the first tile, the context loop, the band and the new keys all add
    the logits of their own distances)."""
    case = make_case([3, 0, 5, 1], [37, 5, 50, 0], 4, 2, 16, 16, page=8, num_pad=2,
                     seed=extent, device=DEVICE)
    _check(*run_both(case, window, 0.0, _sinks(4), rel=_rel(case, extent),
                     num_splits=num_splits, max_query_len=5, config=SMALL_TILES),
           case.num_real)


@needs_kernel_device
def test_relative_logits_over_a_prefill_in_bf16() -> None:
    """A 26-token prefill after 20 keys in 8-query blocks (later blocks' rows far from the
    first keys), bf16 logits on fp32 queries, reduce launch."""
    case = make_case([26, 2], [20, 3], 2, 1, 16, 16, page=8, num_pad=1, seed=4, device=DEVICE)
    _check(*run_both(case, rel=_rel(case, 30, torch.bfloat16), num_splits=2, max_query_len=1,
                     fold_reduce=False, config=SMALL_TILES), case.num_real)


@needs_kernel_device
def test_relative_logits_refused_before_launch() -> None:
    case = make_case([2, 1], [3, 0], 4, 2, 16, 16, page=8, device=DEVICE)
    with pytest.raises(ValueError, match="ragged_attention_triton: rel with softcap=2.0"):
        ragged_attention_triton(*case.args(), 0.3, softcap=2.0, rel=_rel(case, 4))
    with pytest.raises(ValueError, match=r"ragged_attention_triton: rel is torch.float32 of "
                                         r"shape \(\d+, 4, 4, 1\)"):
        ragged_attention_triton(*case.args(), 0.3, rel=_rel(case, 4)[..., None])


@needs_kernel_device
@pytest.mark.parametrize("num_splits,fold", [(1, True), (3, True), (4, False)])
@pytest.mark.parametrize("window,extent", [(0, 0), (12, 12)])
def test_row_sinks_match_reference(window: int, extent: int, num_splits: int,
                                   fold: bool) -> None:
    """Sinks ``[N, H]`` (a logit a query row and head), counted once over the splits, with a
    window and relative logits (Inkling 2's sliding layers)."""
    case = make_case([3, 0, 5, 1], [37, 5, 50, 0], 4, 2, 16, 16, page=8, num_pad=2,
                     seed=window + 1, device=DEVICE)
    sinks = (torch.randn(case.q.shape[0], 4, generator=torch.Generator().manual_seed(3)) * 2
             ).to(DEVICE)
    _check(*run_both(case, window, 0.0, sinks, rel=_rel(case, extent) if extent else None,
                     num_splits=num_splits, max_query_len=5, fold_reduce=fold,
                     config=SMALL_TILES), case.num_real)


@needs_kernel_device
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,extent", [(0, 0), (12, 0), (0, 20)])
def test_alibi_matches_reference(window: int, extent: int, num_splits: int) -> None:
    """ALiBi slopes (a head's slope times kpos - qpos), alone, under a window and beside
    relative logits; sinks on; unsplit and split."""
    case = make_case([3, 0, 5, 1], [37, 5, 50, 0], 4, 2, 16, 16, page=8, num_pad=2,
                     seed=window + extent + 2, device=DEVICE)
    alibi = torch.tensor([0.5, 0.125, 1 / 32, 1 / 128]).to(DEVICE)
    _check(*run_both(case, window, 0.0, _sinks(4), alibi=alibi,
                     rel=_rel(case, extent) if extent else None, num_splits=num_splits,
                     max_query_len=5, config=SMALL_TILES), case.num_real)
