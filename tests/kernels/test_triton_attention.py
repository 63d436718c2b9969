"""Triton ragged paged attention vs the reference: small odd shapes under the interpreter.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (``make test`` sets it before any kernel is
imported) or, without it, on a CUDA device; skipped when it has neither. ``-m gpu`` tests run
the H200 benchmark's shapes in bf16.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

from dspark_compile.ops import attention_reference as reference
from dspark_compile.kernels.targets import TARGETS, target_for_device
from dspark_compile.kernels.attention import (attention_smem, plan_attention,
                                              ragged_attention_triton)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not INTERPRET and not HAS_CUDA,
    reason="needs TRITON_INTERPRET=1 (set before import, as `make test` does) or a GPU")
DEVICE = "cpu" if INTERPRET else "cuda"
# float32: the interpreter computes dots in numpy fp32; CUDA in IEEE fp32 at torch's default
# matmul precision and TF32 (~3e-4 relative) where torch allows it.
TOL = (1e-5, 1e-5) if INTERPRET else (3e-3, 3e-3)  # (atol, rtol)


@dataclass
class Case:
    """Inputs of one ragged attention call (all on DEVICE)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    unused_pages: torch.Tensor
    """Pool pages no request's block table names."""

    def args(self) -> list:
        """Positional arguments, with fresh copies of the pools (the op mutates them)."""
        return [self.q, self.k, self.v, self.k_cache.clone(), self.v_cache.clone(),
                self.query_start_loc, self.seq_lens, self.block_table, self.slot_mapping]


def make_case(lens, contexts, heads, kv_heads, head_dim, page_size, num_pad=0, seed=0,
              dtype=torch.float32, device=DEVICE) -> Case:
    """Random packed layout: request i has ``lens[i]`` new tokens after ``contexts[i]``."""
    g = torch.Generator().manual_seed(seed)
    r, n = len(lens), sum(lens) + num_pad
    pages_per_request = max(-(-(c + l) // page_size) for c, l in zip(contexts, lens)) + 1
    num_pages = r * pages_per_request + 3
    perm = torch.randperm(num_pages, generator=g)  # pages of a request are not contiguous
    table = perm[: r * pages_per_request].view(r, pages_per_request)
    qsl = torch.zeros(r + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    slots = torch.full((n,), -1, dtype=torch.int64)  # padding rows write nothing
    for i, (c, length) in enumerate(zip(contexts, lens)):
        pos = torch.arange(c, c + length)
        slots[qsl[i]: qsl[i] + length] = table[i, pos // page_size] * page_size + pos % page_size

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    pool = (num_pages, page_size, kv_heads, head_dim)
    return Case(rnd(n, heads, head_dim), rnd(n, kv_heads, head_dim), rnd(n, kv_heads, head_dim),
                rnd(*pool), rnd(*pool), qsl.to(torch.int32).to(device),
                torch.tensor([c + l for c, l in zip(contexts, lens)], dtype=torch.int32,
                             device=device),
                table.to(torch.int32).to(device), slots.to(device),
                perm[r * pages_per_request:].to(device))


def run_both(case: Case, scale: float = 0.125, **kw):
    """(triton output, triton pools, reference output, reference pools) on identical inputs.

    The output buffer starts as NaN, so a row the kernels forget to write cannot pass.
    """
    got_args, ref_args = case.args(), case.args()
    out = torch.full_like(case.q, float("nan"))
    got = ragged_attention_triton(*got_args, scale, out=out, **kw)
    assert got is out
    ref = reference.ragged_attention(*ref_args, scale)
    return got, got_args[3:5], ref, ref_args[3:5]


# (lens, contexts, heads, kv_heads, head_dim, page_size, padding rows): GQA 1/4/8, head 64/128,
# pages 16/32, contexts 0..300 across page and tile boundaries (60 + 8 crosses the 64-key
# tile: with splits, a tile some rows see no key of), empty requests, padding rows.
CASES = {
    "gqa1_d64_p16": ([3, 0, 5, 1, 8], [17, 9, 64, 0, 300], 2, 2, 64, 16, 3),
    "gqa4_d128_p32": ([1, 8, 0, 2], [31, 95, 0, 200], 4, 1, 128, 32, 2),
    "gqa8_d64_p16": ([0, 7, 4, 8], [5, 129, 33, 60], 8, 1, 64, 16, 1),
}


@pytest.mark.parametrize("num_splits,fold", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, num_splits: int, fold: bool) -> None:
    """Unsplit, split with the merge in the attention launch (fold), split with a reduce."""
    lens, contexts, *shape, num_pad = CASES[name]
    case = make_case(lens, contexts, *shape, num_pad=num_pad, seed=len(name) + num_splits)
    got, got_pools, ref, ref_pools = run_both(case, num_splits=num_splits,
                                              max_query_len=max(lens), fold_reduce=fold)
    atol, rtol = TOL
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
    assert torch.equal(got[sum(lens):], torch.zeros_like(got[sum(lens):])), "padding rows"
    for g, r in zip(got_pools, ref_pools):
        assert torch.equal(g, r), "KV pool after the write differs from the reference's"


def test_folded_merge_resets_its_counters_and_repeats_exactly() -> None:
    """A folded split launch leaves every counter at 0 (the next launch, or a graph replay,
    starts clean), and calling again gives the same output bit for bit, with 1 to 16 splits
    (``MAX_SPLITS`` 2 to 16, some splits with no key)."""
    from dspark_compile.kernels import attention as ta

    case = make_case([3, 0, 8, 1], [40, 7, 300, 0], 4, 2, 64, 16, num_pad=2, seed=11)
    for splits in (2, 5, 16):
        first, _, ref, _ = run_both(case, num_splits=splits, max_query_len=8, fold_reduce=True)
        again, _, _, _ = run_both(case, num_splits=splits, max_query_len=8, fold_reduce=True)
        torch.testing.assert_close(first, ref, atol=TOL[0], rtol=TOL[1])
        assert torch.equal(first, again)
        bufs = [b for (dev, _), b in ta._counter_buffers.items() if dev == first.device]
        assert bufs and all(int(b.abs().sum()) == 0 for b in bufs), "counters left set"


def test_folded_merge_falls_back_when_counters_run_out(monkeypatch, caplog) -> None:
    """More q-blocks than counters: the launch merges in the reduce kernel, says so once,
    and is still exact."""
    from dspark_compile.kernels import attention as ta

    monkeypatch.setattr(ta, "_COUNTER_SLOTS", 4)
    monkeypatch.setattr(ta, "_counter_fallbacks_logged", set())
    case = make_case([3, 2, 4], [20, 70, 5], 2, 2, 64, 16, num_pad=1, seed=3)
    with caplog.at_level("INFO", logger="dspark_compile"):
        for _ in range(2):
            got, _, ref, _ = run_both(case, num_splits=3, max_query_len=4, fold_reduce=True)
            torch.testing.assert_close(got, ref, atol=TOL[0], rtol=TOL[1])
    assert sum("separate reduce kernel" in r.message for r in caplog.records) == 1


def test_default_plan_and_query_len_hint() -> None:
    """No hints (split rule, BLOCK_Q from N), a too-small max_query_len, a chunked request
    lookup: still exact."""
    lens, contexts = [6, 1, 0, 3], [40, 250, 3, 0]
    case = make_case(lens, contexts, 8, 1, 64, 16, num_pad=2, seed=7)
    atol, rtol = TOL
    chunked = dataclasses.replace(TARGETS["sm_90"], search_chunk=2)  # 5 entries, 3 loads
    # GQA 8 with hint 1: BLOCK_Q = 2, several q-blocks per request
    for hint, cfg in ((None, None), (1, None), (None, chunked)):
        got, got_pools, ref, ref_pools = run_both(case, max_query_len=hint, config=cfg)
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
        assert all(torch.equal(g, r) for g, r in zip(got_pools, ref_pools))


@pytest.mark.parametrize("num_splits", [1, 5])
def test_prefill_with_tiles_smaller_than_the_query_block(num_splits: int) -> None:
    """16-key tiles under 64-query blocks: splits start on tiles some rows see no key of."""
    cfg = dataclasses.replace(TARGETS["sm_90"], attn_tile_n=16)
    case = make_case([40, 3, 0], [0, 20, 7], 2, 2, 64, 16, num_pad=1, seed=5)
    got, got_pools, ref, ref_pools = run_both(case, max_query_len=40, config=cfg,
                                              num_splits=num_splits)
    torch.testing.assert_close(got, ref, atol=TOL[0], rtol=TOL[1])
    assert all(torch.equal(g, r) for g, r in zip(got_pools, ref_pools))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_hidden_non_finite_never_reaches_outputs(num_splits: int, poison: float) -> None:
    """Poison every pool slot no query may see, padding rows and rejected drafts' K/V."""
    lens, contexts = [4, 0, 3, 1], [21, 2, 70, 0]
    case = make_case(lens, contexts, 4, 2, 64, 16, num_pad=2, seed=11)
    clean, _, _, _ = run_both(case, num_splits=num_splits, max_query_len=4)
    page_size = case.k_cache.shape[1]
    for cache in (case.k_cache, case.v_cache):
        cache[case.unused_pages] = poison  # pages of no request
        for i, seq_len in enumerate(case.seq_lens.tolist()):
            for pos in range(seq_len - lens[i], case.block_table.shape[1] * page_size):
                # slots this step overwrites, and slots past seq_lens[i]
                page = int(case.block_table[i, pos // page_size])
                cache[page, pos % page_size] = poison
    n_real = sum(lens)
    qsl = case.query_start_loc.tolist()
    for t in (case.q, case.k, case.v):
        t[n_real:] = poison
    draft = qsl[1] - 1  # request 0's last row, a rejected draft: only it sees its own K/V
    case.k[draft, :, :5] = poison
    case.v[draft, :, 3:9] = poison
    case.v[qsl[2], :, 10:12] = poison  # request 2's first row: every row of it sees this V
    got, got_pools, ref, ref_pools = run_both(case, num_splits=num_splits, max_query_len=4)
    seen = torch.zeros(got.shape[0], dtype=torch.bool)
    seen[[draft, *range(qsl[2], qsl[3])]] = True
    assert torch.isfinite(got[~seen]).all(), "a hidden non-finite value reached an output"
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)), "non-finite where visible"
    atol, rtol = TOL
    fin = torch.isfinite(ref)
    torch.testing.assert_close(got[fin], ref[fin], atol=atol, rtol=rtol)
    torch.testing.assert_close(got[:draft], clean[:draft], atol=atol, rtol=rtol)
    assert torch.equal(got[n_real:], torch.zeros_like(got[n_real:]))
    for g, r in zip(got_pools, ref_pools):
        assert torch.equal(g.isnan(), r.isnan()) and torch.equal(g.nan_to_num(), r.nan_to_num())


def test_split_rule_uses_shapes_only() -> None:
    cfg = TARGETS["sm_90"]
    sizes = {bs: plan_attention(bs * 8, bs, 16, 8, 1040, 8, cfg, 132) for bs in (1, 8, 64, 256)}
    assert sizes[1].num_splits == 8 and sizes[8].num_splits == 8, "small batches must split"
    assert sizes[64].num_splits == sizes[256].num_splits == 1, "full GPU: no split, no reduce"
    p = sizes[64]
    assert (p.block_q, p.block_m, p.grid) == (8, 16, (64 * 8 // 8 + 64 + 1, 8, 1))
    assert (p.new_n, p.search, p.num_warps, p.max_registers) == (16, 256, 4, 128)
    wide = plan_attention(512, 64, 16, 8, 1040, 512, cfg, 132)  # no hint: 64-row tiles
    assert (wide.block_m, wide.num_warps, wide.max_registers) == (64, 8, None)
    assert plan_attention(8, 1, 16, 8, 64, 8, cfg, 132).num_splits == 1, "too few keys"
    assert plan_attention(4, 1, 2, 2, 4096, 4, cfg, 132, num_splits=5).num_splits == 5


def test_wide_heads_cut_stages_then_tiles_to_fit_shared_memory() -> None:
    """Head dims up to 128 keep the table's tiles; 64 query heads on one KV head of 512 (the
    MQA of DeepSeek-V4) in bf16 cut 3 stages x 32 keys to 2 x 16; float32 at that width does
    not fit even 16 keys in one stage and is refused, naming the shapes, before a launch."""
    cfg = TARGETS["sm_90"]
    base = plan_attention(8, 1, 64, 1, 4096, 8, cfg, 132, head_dim_pad=128)
    assert (base.tile_n, base.num_stages) == (cfg.attn_tile_n, cfg.attn_num_stages)
    wide = plan_attention(8, 1, 64, 1, 4096, 8, cfg, 132, head_dim_pad=512, elem_bytes=2)
    assert (wide.block_m, wide.tile_n, wide.num_stages, wide.new_n) == (64, 16, 2, 16)
    assert attention_smem(64, 16, 2, 512, 2) <= cfg.attn_max_smem
    with pytest.raises(ValueError, match="64 rows .* head dim 512 in 4-byte elements"):
        plan_attention(8, 1, 64, 1, 4096, 8, cfg, 132, head_dim_pad=512, elem_bytes=4)


def test_tier_set_compiles_few_kernel_variants() -> None:
    """Every specialised choice of a launch, over the 72-tier set of 256 requests x block 8:
    the split count, N and R are runtime arguments, so capture compiles a handful of variants
    (each one ~1 s), not one per tier."""
    from dspark_compile.session.tiers import tier_set

    from dspark_compile.kernels.attention import _max_splits

    cfg = TARGETS["sm_90"]
    variants = set()
    for tier in tier_set(256, 8):
        p = plan_attention(tier.tokens, tier.request_slots, 16, 8, 1040, 8, cfg, 132)
        split = p.num_splits > 1
        variants.add((p.block_q, p.block_m, p.tile_n, p.new_n, p.search, split,
                      _max_splits(p.num_splits) if split and cfg.attn_fold_reduce else None,
                      tier.request_slots + 1 <= p.search, p.num_warps, p.max_registers))
    assert len(variants) <= 4, variants


def test_target_table() -> None:
    assert target_for_device("cpu").name == "sm_90"
    for name in ("gfx942", "gfx950"):
        assert TARGETS[name].warp_size == 64 and TARGETS[name].fp32_dot_precision == "ieee"
    assert TARGETS["sm_90"].warp_size == 32


@pytest.mark.parametrize("mutate, match", [
    (lambda c: setattr(c, "k", c.k[:, :1]), r"k .* must be \[N, Hkv, Dk\]"),
    (lambda c: setattr(c, "seq_lens", c.seq_lens[:-1]), "need R rows"),
    (lambda c: setattr(c, "slot_mapping", c.slot_mapping.float()), "slot_mapping is torch.fl"),
    (lambda c: setattr(c, "block_table", c.block_table[:1]), "need R rows"),
    (lambda c: setattr(c, "q", c.q[:, :3]), "divides q's 3 heads"),
    (lambda c: setattr(c, "v_cache", c.v_cache.half()), "must match k_cache"),
    (lambda c: setattr(c, "query_start_loc", c.query_start_loc[None]), "must be a 1-D"),
    (lambda c: setattr(c, "slot_mapping", c.slot_mapping[:-1]), "slot_mapping .* N"),
])
def test_bad_inputs_raise_value_error(mutate, match: str) -> None:
    case = make_case([2, 1], [3, 0], 4, 2, 64, 16)
    mutate(case)
    with pytest.raises(ValueError, match=match):
        ragged_attention_triton(*case.args(), 0.125)
    ok = make_case([1], [0], 2, 2, 64, 16)
    with pytest.raises(ValueError, match="max_query_len"):
        ragged_attention_triton(*ok.args(), 0.1, max_query_len=0)
    with pytest.raises(ValueError, match="out .* must match q"):
        ragged_attention_triton(*ok.args(), 0.1, out=torch.empty_like(ok.q[:, :1]))


# (heads, kv heads, head dim, page, context): the benchmark's Llama shape, and 64 query heads
# on one KV head of 512 (DeepSeek-V4's MQA, whose plan cuts its tiles to fit shared memory)
GPU_SHAPES = {"llama": (16, 8, 128, 16, 1024), "wide_mqa": (64, 1, 512, 64, 300)}


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not HAS_CUDA, reason="needs a GPU and no interpreter")
@pytest.mark.parametrize("bs, mixed, shape", [
    *((bs, mixed, "llama") for bs in (1, 8, 64, 256) for mixed in (False, True)),
    *((bs, True, "wide_mqa") for bs in (1, 8, 64))])
def test_gpu_bf16_real_shapes(bs: int, mixed: bool, shape: str) -> None:
    """Verify width 8 or a 1..8 mix at real shapes (``GPU_SHAPES``), bf16."""
    heads, kv_heads, dim, page, context = GPU_SHAPES[shape]
    g = torch.Generator().manual_seed(bs)
    lens = torch.randint(1, 9, (bs,), generator=g).tolist() if mixed else [8] * bs
    case = make_case(lens, [context] * bs, heads, kv_heads, dim, page, num_pad=5, seed=bs,
                     dtype=torch.bfloat16, device="cuda")
    got, got_pools, ref, ref_pools = run_both(case, scale=dim ** -0.5, max_query_len=8)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    assert torch.equal(got[sum(lens):], torch.zeros_like(got[sum(lens):]))
    assert all(torch.equal(g, r) for g, r in zip(got_pools, ref_pools))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not HAS_CUDA, reason="needs a GPU and no interpreter")
@pytest.mark.parametrize("bs", [1, 8])
def test_gpu_early_reads_equal_late_reads_bitwise(bs: int) -> None:
    """q/k/v from a skinny launch (PDL), then attention with ``early_reads`` (request lookup,
    block table and first K/V tile read before the wait): captured in a CUDA graph and
    replayed over new activations, committed KV, block tables and lengths copied in before
    each replay, it gives the bits of the same chain without early reads."""
    from dspark_compile.kernels.device import device_target
    from dspark_compile.kernels.skinny import skinny_linear_triton

    cfg, _ = device_target(torch.device("cuda"))
    if not cfg.pdl:
        pytest.skip("this GPU's target does not launch with PDL")
    h, hkv, d, page, k_in = 16, 8, 128, 16, 512
    lens = torch.randint(1, 9, (bs,), generator=torch.Generator().manual_seed(bs)).tolist()
    n = sum(lens)
    w = torch.randn((h + 2 * hkv) * d, k_in, device="cuda", dtype=torch.bfloat16) / k_in ** 0.5
    x = torch.randn(n, k_in, device="cuda", dtype=torch.bfloat16)

    def contexts(step: int) -> list[int]:  # request 0 ends at 708 keys: same pages each step
        return [708 - lens[0]] + [300 + 97 * ((i + step) % 5) for i in range(1, bs)]

    first = make_case(lens, contexts(0), h, hkv, d, page, seed=0, dtype=torch.bfloat16,
                      device="cuda")
    meta = [first.query_start_loc.clone(), first.seq_lens.clone(), first.block_table.clone(),
            first.slot_mapping.clone()]
    pools = {early: (first.k_cache.clone(), first.v_cache.clone()) for early in (False, True)}

    def chain(early: bool) -> torch.Tensor:
        qkv, _ = skinny_linear_triton(x, w)
        q, k, v = qkv.view(n, h + 2 * hkv, d).split([h, hkv, hkv], dim=1)
        return ragged_attention_triton(q, k, v, *pools[early], *meta, d ** -0.5,
                                       max_query_len=8, early_reads=early)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs, outs = {}, {}
    with torch.cuda.stream(side):
        for early in (False, True):
            chain(early)
            graphs[early] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[early], stream=side):
                outs[early] = chain(early)
    torch.cuda.current_stream().wait_stream(side)
    for step in range(6):
        new = make_case(lens, contexts(step + 1), h, hkv, d, page, seed=step + 1,
                        dtype=torch.bfloat16, device="cuda")
        x.copy_(torch.randn_like(x))
        for dst, src in zip(meta, (new.query_start_loc, new.seq_lens, new.block_table,
                                   new.slot_mapping)):
            dst.copy_(src)
        for early in (False, True):
            pools[early][0].copy_(new.k_cache)
            pools[early][1].copy_(new.v_cache)
            graphs[early].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[True], outs[False]), step
        assert all(torch.equal(a, b) for a, b in zip(pools[True], pools[False])), step
        qkv = x.float() @ w.float().t()
        want = reference.ragged_attention(
            *[t.to(torch.bfloat16) for t in qkv.view(n, h + 2 * hkv, d).split(
                [h, hkv, hkv], dim=1)], new.k_cache.clone(), new.v_cache.clone(),
            new.query_start_loc, new.seq_lens, new.block_table, new.slot_mapping, d ** -0.5)
        torch.testing.assert_close(outs[True], want, atol=3e-2, rtol=3e-2)
