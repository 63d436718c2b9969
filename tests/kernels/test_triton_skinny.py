"""``dspark::skinny_linear``'s Triton kernel against an fp32 oracle: plain, SiLU-and-mul and
RMSNorm (with the residual add) prologues, the SiLU-and-mul epilogue, split-K folded into the
launch, the path past ``skinny_max_m``, input checks, the plan, and ahead-of-time compiles for
cuda:90, gfx942 and gfx950.

Kernel cases run under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by
conftest.py without a GPU) in float16 (the interpreter mis-reads bf16 in ``tl.dot``); bf16 runs
on a GPU only. The AOT cases run this file as a script without the interpreter (tests/aot.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch
import torch.nn.functional as F

from aot import TARGET_NAMES, aot_tests, compile_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                         reason="needs a GPU or TRITON_INTERPRET=1")
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU")])]
MODES = ("plain", "glu", "rms", "rms_res")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _case(m: int, n: int, k: int, mode: str, glu_out: bool, dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(_device())

    n_w = 2 * n if glu_out else n
    args = dict(x=rnd(m, 2 * k if mode == "glu" else k), w=rnd(n_w, k, scale=k ** -0.5),
                bias=rnd(n_w), eps=1e-6, glu=mode == "glu", glu_out=glu_out)
    if mode.startswith("rms"):
        args["gamma"] = (torch.rand(k, generator=g) + 0.5).to(dtype).to(_device())
    if mode == "rms_res":
        args["residual"] = rnd(m, k)
    return args


def _oracle(x, w, bias=None, gamma=None, eps=0.0, glu=False, residual=None, glu_out=False):
    """fp32 math of the op; ``h`` rounded to the dtype as the model's residual add is."""
    h = None
    k = w.shape[1]
    if glu:
        a = F.silu(x[:, :k].float()) * x[:, k:].float()
    elif gamma is not None:
        if residual is not None:
            x = h = (x.float() + residual.float()).to(x.dtype)
        hf = x.float()
        a = gamma.float() * hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        a = x.float()
    y = a @ w.float().t() + (0 if bias is None else bias.float())
    if glu_out:
        y = F.silu(y[:, :w.shape[0] // 2]) * y[:, w.shape[0] // 2:]
    return y, h


def _check(args: dict, **over) -> tuple[torch.Tensor, torch.Tensor]:
    from dspark_compile.kernels.skinny import skinny_linear_triton

    got, h = skinny_linear_triton(**args, **over)
    want, want_h = _oracle(**args)
    assert got.shape == want.shape and got.dtype == args["x"].dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    if want_h is None:
        assert h.numel() == 0
    else:  # the sum is rounded once, as x + residual in the model's dtype
        assert torch.equal(h, want_h)
    return got, h


@needs_kernel_device
@pytest.mark.parametrize("m, n, k, over", [
    (3, 128, 256, {}),                                        # one tile row of the plan
    (1, 40, 200, {"block_k": 64, "block_n": 16}),             # N and K not tile multiples
    (20, 64, 512, {"split_k": 4, "block_n": 16}),             # 32-row tile, four splits
    (40, 48, 384, {"split_k": 3, "block_k": 64, "block_n": 32}),  # 64 rows, uneven last split
    (5, 32, 640, {"block_k": 256, "num_stages": 3, "block_n": 16}),  # the LM head's K step
])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_matches_oracle(m, n, k, over, mode, dtype) -> None:
    from dspark_compile.kernels.targets import TARGETS

    cfg = dataclasses.replace(TARGETS["sm_90"], skinny_max_m=64)  # the 64-row tile too
    for glu_out in (False, True):
        args = _case(m, n, k, mode, glu_out, dtype)
        got, h = _check(args, config=cfg, **over)
        again, h2 = _check(args, config=cfg, **over)
        assert torch.equal(got, again) and torch.equal(h, h2), \
            "two runs must agree bit for bit (ordered split sums)"


@needs_kernel_device
@pytest.mark.parametrize("mode", ["plain", "rms_res"])
@pytest.mark.parametrize("variant", [dict(tma=True), dict(swap=True),
                                     dict(swap=True, tma=True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_descriptor_and_swapped_dot_variants(mode, variant, dtype) -> None:
    """``tma=True`` (a tensor descriptor of ``w``; TMA on sm_90) and ``swap=True`` (``a @ w.T``
    tiles) give the default path's result."""
    args = _case(5, 48, 200, mode, True, dtype, seed=3)
    over = dict(block_k=64, block_n=16, split_k=2)
    got, _ = _check(args, **variant, **over)
    ref, _ = _check(args, tma=False, swap=False, **over)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)


@needs_kernel_device
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("over", [dict(block_k=64, block_n=16, split_k=3),  # uneven splits
                                  dict(block_k=64, block_n=16, swap=True),
                                  dict(block_k=64, block_n=16, tma=True)])
def test_first_weight_tile_loaded_early_gives_the_same_bits(mode, over) -> None:
    """``weight_settled`` (the first weight tiles loaded before the PDL wait, their K step
    peeled off the loop) gives the loop's result bit for bit."""
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.skinny import skinny_linear_triton

    cfg = dataclasses.replace(TARGETS["sm_90"], skinny_early_w_max_m=16)
    for glu_out in (False, True):
        args = _case(5, 48, 328, mode, glu_out, torch.float16, seed=4)
        got = skinny_linear_triton(**args, config=cfg, weight_settled=True, **over)
        want = skinny_linear_triton(**args, config=cfg, **over)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_kernel_device
@pytest.mark.parametrize("mode", MODES)
def test_rows_past_the_kernel_take_the_input_launch_and_mm(mode) -> None:
    """Past ``skinny_max_m``: the prologue in its own launch, then ``torch.mm``; same results."""
    from dspark_compile.kernels.targets import TARGETS

    cfg = dataclasses.replace(TARGETS["sm_90"], skinny_max_m=4)
    for glu_out in (False, True):
        _check(_case(9, 32, 96, mode, glu_out, torch.float16, seed=5), config=cfg)
        _check(_case(0, 32, 96, mode, glu_out, torch.float16), config=cfg)  # no rows


@needs_kernel_device
@pytest.mark.parametrize("mode", ("plain", "glu", "rms_res"))
def test_long_k_past_the_kernel_sums_k_chunk_partials_in_order(mode, monkeypatch) -> None:
    """Past ``skinny_max_m`` with K >= ``mid_split_min_ratio`` x N (the down projection):
    partials of ``mid_split_k`` K chunks, summed in chunk order with the bias in fp32 and
    rounded once; other shapes keep the one matmul."""
    from dspark_compile.kernels import skinny as triton_skinny
    from dspark_compile.kernels.targets import TARGETS

    cfg = dataclasses.replace(TARGETS["sm_90"], skinny_max_m=4, mid_split_k=4,
                              mid_split_full_m=12, mid_split_max_m=12, mid_split_min_ratio=4)
    seen = []
    partials = triton_skinny._split_partials

    def spy(a, w, chunks):
        seen.append(partials(a, w, chunks))
        return seen[-1]

    monkeypatch.setattr(triton_skinny, "_split_partials", spy)
    args = _case(9, 24, 128, mode, False, torch.float16, seed=3)  # K = 5.3 N, 9 rows
    got, _ = _check(args, config=cfg)
    assert len(seen) == 1 and seen[0].shape == (4, 9, 24) and seen[0].dtype == torch.float32
    want = seen[0][0] + seen[0][1]
    want = want + seen[0][2]
    want = want + seen[0][3] + args["bias"].float()
    assert torch.equal(got, want.to(got.dtype))  # the sum's order and its one rounding
    for m, n in ((13, 24), (9, 40)):  # more rows than mid_split_max_m; K < 4 N
        _check(_case(m, n, 128, mode, False, torch.float16, seed=4), config=cfg)
    _check(_case(9, 24, 128, mode, True, torch.float16, seed=5), config=cfg)  # glu_out
    assert len(seen) == 1
    odd = dataclasses.replace(cfg, mid_split_k=3)  # a chunk of 128 / 3 columns: no split
    _check(_case(9, 24, 128, mode, False, torch.float16, seed=6), config=odd)
    assert len(seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a GPU")
def test_down_projection_at_192_rows_in_chunks_matches_one_matmul() -> None:
    """The 1.1B model's down projection at bs 64 (192 rows, bf16, SiLU-and-mul input): the
    H200 entry's 4 K chunks against one ``torch.mm`` and the fp32 oracle; replays of one CUDA
    graph give the same bits."""
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.skinny import _mid_split, skinny_linear_triton

    cfg = TARGETS["sm_90"]
    assert _mid_split(192, 2048, 8192, False, cfg) == 4
    args = _case(192, 2048, 8192, "glu", False, torch.bfloat16, seed=11)
    got, _ = _check(args, config=cfg)
    one, _ = skinny_linear_triton(**args, config=dataclasses.replace(cfg, mid_split_k=1))
    torch.testing.assert_close(got, one, atol=2e-2, rtol=2e-2)
    skinny_linear_triton(**args, config=cfg)  # the sum kernel compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = skinny_linear_triton(**args, config=cfg)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


def test_mid_split_rule() -> None:
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.skinny import _mid_split

    h200 = TARGETS["sm_90"]
    assert _mid_split(192, 2048, 8192, False, h200) == 4  # down at bs 64
    assert _mid_split(256, 2048, 8192, False, h200) == 2  # past 192 rows: halved
    assert _mid_split(384, 2048, 8192, False, h200) == 2
    assert _mid_split(64, 2048, 8192, False, h200) == 4
    assert _mid_split(192, 2048, 8200, False, h200) == 1  # a chunk of 2050: misaligned
    assert _mid_split(768, 2048, 8192, False, h200) == 1  # bs 256: cuBLAS as it is
    assert _mid_split(192, 4096, 2048, False, h200) == 1  # q+k+v
    assert _mid_split(192, 2048, 2048, False, h200) == 1  # o
    assert _mid_split(192, 8192, 8192, True, h200) == 1  # a SiLU epilogue
    assert _mid_split(0, 2048, 8192, False, h200) == 1
    for name in ("sm_80", "gfx942", "gfx950"):  # not measured there: off
        assert _mid_split(192, 2048, 8192, False, TARGETS[name]) == 1


def _rotary_inputs(m: int, d: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(m, d // 2, generator=g) * 6
    cos, sin = (torch.cat([f(ang)] * 2, 1).to(dtype).to(_device()) for f in (torch.cos, torch.sin))
    return cos, sin


# (rtol, atol) between two fp16 launches of one matmul whose tiles differ (BLOCK_N, split):
# the interpreter's ``tl.dot`` is numpy's matmul, whose fp32 summation order (blocking, FMA)
# depends on the operand shapes and on the CPU's BLAS kernels, so the fp32 sums may differ in
# their last bits and round to fp16 values one ulp apart (row 1, column 209 of the
# 2 x 256 x 128 case, with OpenBLAS's Haswell/Zen kernels). rtol 2^-9 is 2 ulps anywhere in a
# binade; atol 2^-14 (fp16's smallest normal) covers sums that cancel to near zero.
TILE_ORDER_TOL = (2 ** -9, 2 ** -14)


@needs_kernel_device
@pytest.mark.parametrize("m, n, k, d, rot_cols, mode, over", [
    (3, 128, 256, 16, 96, "rms_res", {}),                   # q 4 heads + k 2 heads, v after
    (5, 96, 128, 16, 80, "plain", {"block_n": 32}),          # a tile half rotated, N uneven
    (20, 256, 512, 32, 192, "rms", {"split_k": 4}),          # the split merge's epilogue
    (2, 256, 128, 128, 128, "plain", {}),                    # a head of 128: 128-column tiles
])
@pytest.mark.parametrize("where", ["epilogue", "after"])
def test_rotary_epilogue_equals_rotating_the_plain_output(m, n, k, d, rot_cols, mode, over,
                                                           where) -> None:
    """The epilogue (or, below ``skinny_rope_min_m`` rows, the rotary kernel after the plain
    launch) rotates the rounded output with the reference op's roundings: bit for bit what
    ``dspark::rotary_apply``'s math gives on the plain output of the same tiles. The epilogue
    makes ``BLOCK_N`` a multiple of the head dim (whole heads a tile), so with a head of 128
    its tiles (and split) are not the default plain launch's: against that launch every
    column agrees to fp16 rounding (``TILE_ORDER_TOL``), bit for bit only where the plans
    are the same."""
    from dspark_compile.ops.linear import rotate as _rotate
    from dspark_compile.kernels.device import device_target
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.skinny import plan_skinny, skinny_linear_triton

    dtype = torch.float16
    cfg = dataclasses.replace(TARGETS["sm_90"], skinny_rope_min_m=1 if where == "epilogue"
                              else m + 1)
    args = _case(m, n, k, mode, False, dtype)
    cos, sin = _rotary_inputs(m, d, dtype)
    sm_count = device_target(args["x"].device)[1]
    rms = mode.startswith("rms")
    rot_plan = plan_skinny(m, n, k, cfg, sm_count, rms=rms,
                           rot_d=d if where == "epilogue" else 0, **over)
    same_tiles = dict(block_n=rot_plan.block_n, block_k=rot_plan.block_k,
                      split_k=rot_plan.split_k, num_warps=rot_plan.num_warps,
                      num_stages=rot_plan.num_stages, tma=rot_plan.tma, swap=rot_plan.swap)
    assert plan_skinny(m, n, k, cfg, sm_count, rms=rms, **same_tiles) == rot_plan
    plain, h = skinny_linear_triton(**args, config=cfg, **over)
    tiled, tiled_h = skinny_linear_triton(**args, config=cfg, **same_tiles)
    got, got_h = skinny_linear_triton(**args, cos=cos, sin=sin, rot_cols=rot_cols, config=cfg,
                                      **over)

    def rotated(y):
        heads = y[:, :rot_cols].unflatten(1, (-1, d))
        return torch.cat([_rotate(heads, cos, sin).flatten(1), y[:, rot_cols:]], 1)

    # the same tiles: the same dots and roundings, then the reference op's rotation
    assert torch.equal(got, rotated(tiled)) and torch.equal(got_h, tiled_h)
    assert torch.equal(got_h, h)  # x + residual, rounded once: no tile in it
    if plan_skinny(m, n, k, cfg, sm_count, rms=rms, **over) == rot_plan:
        assert torch.equal(tiled, plain) and torch.equal(got, rotated(plain))
    else:  # other tiles: the columns left unrotated agree to the fp16 rounding of the sums
        assert where == "epilogue" and d > cfg.skinny_block_n  # only whole heads change tiles
        rtol, atol = TILE_ORDER_TOL
        torch.testing.assert_close(got[:, rot_cols:], plain[:, rot_cols:], rtol=rtol, atol=atol)
        torch.testing.assert_close(tiled, plain, rtol=rtol, atol=atol)


@needs_kernel_device
def test_rotary_past_the_kernel_rows_rotates_in_place() -> None:
    from dspark_compile.ops.linear import rotate as _rotate
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.skinny import skinny_linear_triton

    cfg = dataclasses.replace(TARGETS["sm_90"], skinny_max_m=2)
    args = _case(6, 64, 64, "rms_res", False, torch.float16)
    cos, sin = _rotary_inputs(6, 16, torch.float16)
    plain, _ = skinny_linear_triton(**args, config=cfg)
    got, _ = skinny_linear_triton(**args, cos=cos, sin=sin, rot_cols=48, config=cfg)
    want = torch.cat([_rotate(plain[:, :48].unflatten(1, (3, 16)), cos, sin).flatten(1),
                      plain[:, 48:]], 1)
    assert torch.equal(got, want)


def test_rotary_epilogue_inputs_are_checked() -> None:
    from dspark_compile.kernels.skinny import plan_skinny, skinny_linear_triton
    from dspark_compile.kernels.targets import TARGETS

    args = _case(3, 64, 64, "plain", False, torch.float16)
    cos, sin = _rotary_inputs(3, 16, torch.float16)
    with pytest.raises(ValueError, match="rot_cols=40; it must be a multiple of the head dim 16"):
        skinny_linear_triton(**args, cos=cos, sin=sin, rot_cols=40)
    with pytest.raises(ValueError, match="cos is NoneType"):
        skinny_linear_triton(**args, sin=sin, rot_cols=32)
    with pytest.raises(ValueError, match="one power of two"):
        skinny_linear_triton(**args, cos=cos[:, :12], sin=sin[:, :12], rot_cols=24)
    glu = _case(3, 32, 64, "plain", True, torch.float16)
    with pytest.raises(ValueError, match="with glu_out=True"):
        skinny_linear_triton(**glu, cos=cos, sin=sin, rot_cols=32)
    assert plan_skinny(3, 4096, 2048, TARGETS["sm_90"], 132, rot_d=128).block_n == 128
    assert plan_skinny(3, 96, 64, TARGETS["sm_90"], 132, rot_d=16).block_n == 64


@needs_kernel_device
def test_split_counters_are_left_at_zero() -> None:
    from dspark_compile.kernels import attention as triton_attention
    from dspark_compile.kernels.skinny import skinny_linear_triton

    args = _case(4, 64, 1024, "rms_res", True, torch.float16, seed=7)
    for split in (2, 4, 8):
        skinny_linear_triton(**args, split_k=split, block_n=16, block_k=128)
        for buf in triton_attention._counter_buffers.values():
            assert int(buf.count_nonzero()) == 0


def test_bad_inputs_are_refused_before_launch() -> None:
    from dspark_compile.kernels.skinny import skinny_linear_triton

    def base(**over):
        args = _case(3, 16, 32, "plain", False, torch.float16)
        args.update(over)
        return args

    x = base()["x"]
    f16 = dict(dtype=torch.float16, device=x.device)  # x's device: only the named rule breaks
    cases = [
        (dict(x=x.float()), "float32"),
        (dict(x=x.t()), "dense last dim"),
        (dict(w=torch.zeros(16, 24, **f16)), "K=32"),
        (dict(bias=torch.zeros(15, **f16)), "bias is"),
        (dict(glu=True), "K=16"),
        (dict(residual=torch.zeros_like(x), gamma=None), "without gamma"),
        (dict(gamma=torch.ones(32, **f16), glu=True, x=torch.zeros(3, 64, **f16)),
         "one or the other"),
        (dict(glu_out=True, w=torch.zeros(15, 32, **f16), bias=None), "glu_out=True"),
        (dict(w=torch.zeros(16, 32, dtype=torch.float16, device="meta")),
         f"w is .* on meta; .* on {x.device}"),
    ]
    for over, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_linear_triton(**base(**over))
    from dspark_compile.kernels.targets import TARGETS

    with pytest.raises(ValueError, match="skinny_max_m=128; .* at most 64"):
        dataclasses.replace(TARGETS["sm_90"], skinny_max_m=128)  # past the 64-row tile


def test_plan_tiles_and_split() -> None:
    from dspark_compile.kernels.targets import TARGETS
    from dspark_compile.kernels.skinny import plan_skinny

    cfg = TARGETS["sm_90"]
    o = plan_skinny(3, 2048, 2048, cfg, 132)  # the 1.1B model's o projection
    assert (o.block_m, o.block_n, o.split_k, o.grid) == (16, 64, 4, (32, 4))
    assert o.k_per_split == 512 and o.k_per_split % o.block_k == 0
    gate_up = plan_skinny(24, 8192, 2048, cfg, 132, glu_out=True)  # 8192 outputs of 16384 rows
    assert (gate_up.block_m, gate_up.split_k, gate_up.grid) == (32, 1, (128, 1))
    smem = (2 * gate_up.block_n + gate_up.block_m) * gate_up.block_k * 2 * gate_up.num_stages
    assert smem <= cfg.skinny_max_smem
    assert plan_skinny(64, 64, 256, cfg, 132).split_k == 1  # K too short to split
    assert plan_skinny(3, 64, 300, cfg, 132).tma is False or not cfg.skinny_tma
    assert plan_skinny(3, 64, 300, cfg, 132, tma=True).tma is False  # 600-byte rows: no TMA
    head = plan_skinny(3, 32000, 2048, cfg, 132, rms=True)  # LM head with the final norm
    assert (head.block_k, head.num_stages, head.split_k) == (
        cfg.skinny_rms_block_k, cfg.skinny_rms_num_stages, 1)
    assert plan_skinny(3, 32000, 2048, cfg, 132).block_k == cfg.skinny_block_k  # no prologue
    assert plan_skinny(3, 4096, 2048, cfg, 132, rms=True).block_k == cfg.skinny_block_k  # split
    assert plan_skinny(3, 8192, 2048, cfg, 132, rms=True, glu_out=True).block_k == \
        cfg.skinny_block_k


# --------------------------------------------------------------------------- ahead of time
_AOT_BASE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, PRO=0, HAS_BIAS=False,
                 HAS_RES=False, EVEN_N=True, EVEN_K=True, W_DESC=False, EPI_GLU=False, SWAP=False,
                 ROT_D=0, EARLY_W=False)
AOT_CASES = {  # case -> constexprs (the base's, changed where named)
    "plain_m16": _AOT_BASE,
    "rms_res_glu_split": {**_AOT_BASE, "BLOCK_M": 32, "SPLIT_K": 4, "PRO": 2, "HAS_BIAS": True,
                          "HAS_RES": True, "EVEN_N": False, "EVEN_K": False, "EPI_GLU": True},
    "glu_m64_swap": {**_AOT_BASE, "BLOCK_M": 64, "SPLIT_K": 2, "PRO": 1, "SWAP": True},
    # q/k/v with the residual add + norm and the q/k rotation in the epilogue (heads of 128)
    "rms_res_rope_split": {**_AOT_BASE, "BLOCK_N": 128, "SPLIT_K": 2, "PRO": 2, "HAS_RES": True,
                           "ROT_D": 128},
    # the first weight tiles (gate and up) loaded before the PDL wait
    "rms_res_glu_split_early": {**_AOT_BASE, "BLOCK_M": 32, "SPLIT_K": 4, "PRO": 2,
                                "HAS_RES": True, "EVEN_N": False, "EVEN_K": False,
                                "EPI_GLU": True, "EARLY_W": True},
}


def _compile_all() -> dict:
    from dspark_compile.kernels import skinny as triton_skinny
    from dspark_compile.kernels.targets import TARGETS

    kernel = triton_skinny._skinny_kernel
    pointers = {a: "bf16" for a in kernel.arg_names if a.endswith("_ptr")}
    pointers.update(part_ptr="fp32", counter_ptr="i32")
    out: dict = {}
    early_asm: dict = {}
    for case, consts in AOT_CASES.items():
        for target in TARGET_NAMES:
            cfg = TARGETS[target]
            opts = {"num_warps": cfg.skinny_num_warps, "num_stages": 4}
            asm = early_asm if (case, target) == ("rms_res_glu_split_early", "sm_90") else None
            out.setdefault(case, {})[target] = compile_kernel(
                kernel, pointers, consts, target, opts, scalars={"eps": "fp32"}, asm=asm)
    out["pipelined_shared_bytes"] = _pipelined_shared(kernel, pointers)
    out["plan_shared_bytes"] = {target: {case: _plan_shared(kernel, pointers, target, *args)
                                         for case, args in PLAN_CASES.items()}
                                for target in PLAN_TARGETS}
    asm = {}
    compile_kernel(kernel, {**pointers, **{a: "fp16" for a in pointers if pointers[a] == "bf16"}},
                   AOT_CASES["rms_res_rope_split"], "sm_90",
                   {"num_warps": 4, "num_stages": 4, **triton_skinny.LAUNCH_OPTIONS},
                   scalars={"eps": "fp32"}, asm=asm)
    out["rope_fp16_ptx"] = {op: len(re.findall(op, asm["ptx"]))
                            for op in (r"\bfma\.\S*f16", r"\bmul\.rn\.f16", r"\bsub\.rn\.f16")}
    asm: dict = {}
    compile_kernel(kernel, pointers, AOT_CASES["rms_res_glu_split"], "sm_90",
                   {"num_warps": 4, "num_stages": 4}, scalars={"eps": "fp32"}, asm=asm)
    ptx = asm["ptx"]
    out["pdl_ptx"] = {op: ptx.find(op) for op in (
        "griddepcontrol.wait", "griddepcontrol.launch_dependents", "ld.global", "atom.global",
        "cp.async.c")}
    out["pdl_ptx_early"] = {op: early_asm["ptx"].find(op) for op in (
        "griddepcontrol.wait", "ld.global", "st.global", "atom.global")}
    pro = triton_skinny._prologue_kernel
    pointers = {a: "bf16" for a in pro.arg_names if a.endswith("_ptr")}
    for target in TARGET_NAMES:
        out.setdefault("prologue_rms_res", {})[target] = compile_kernel(
            pro, pointers, dict(PRO=2, HAS_RES=True, BLOCK_K=2048), target, {"num_warps": 4},
            scalars={"eps": "fp32"})
    return out


PLAN_TARGETS = (*TARGET_NAMES, "sm_80")
"""Targets whose planned skinny launches are compiled for their shared memory (sm_80 too: its
163 KB is below the default pipeline budget)."""
PLAN_CASES = {  # case -> (m, n, k, prologue, residual, glu_out, rot_d): launches the lowering makes
    # q/k/v of heads of 256 with no norm before it (a plain or LayerNorm input), early tile asked
    "qkv_rot256_plain_m3": (3, 10752, 3584, 0, True, False, 256),
    "qkv_rot128_plain_m3": (3, 12288, 4096, 0, True, False, 128),
    "gate_up_plain_m3": (3, 16384, 4096, 0, True, True, 0),
    "gate_up_plain_m24": (24, 16384, 4096, 0, True, True, 0),
    "qkv_rot256_rms_m3": (3, 10752, 3584, 2, True, False, 256),
    "gate_up_rms_m24": (24, 16384, 4096, 2, True, True, 0),
}


def _plan_shared(kernel, pointers: dict, target: str, m: int, n: int, k: int, pro: int,
                 res: bool, glu_out: bool, rot_d: int) -> int:
    """Shared memory (LDS on AMD) of ``target``'s build of the launch ``skinny_linear_triton``
    makes for these shapes (its plan, the early tile as the plan keeps it)."""
    from dspark_compile.kernels import skinny as triton_skinny
    from dspark_compile.kernels.skinny import plan_skinny
    from dspark_compile.kernels.targets import TARGETS

    cfg = TARGETS[target]
    plan = plan_skinny(m, n, k, cfg, cfg.default_sm_count, glu_out=glu_out, rms=pro == 2,
                       rot_d=rot_d, staged_x=pro == 0, early_w=m <= cfg.skinny_early_w_max_m)
    consts = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                  SPLIT_K=plan.split_k, PRO=pro, HAS_BIAS=False, HAS_RES=res, EVEN_N=True,
                  EVEN_K=True, W_DESC=plan.tma, EPI_GLU=glu_out, SWAP=plan.swap, PDL=cfg.pdl,
                  ROT_D=rot_d, EARLY_W=plan.early_w)
    return _shared(kernel, pointers, consts, {
        "num_warps": plan.num_warps, "num_stages": plan.num_stages,
        **triton_skinny.LAUNCH_OPTIONS}, target)


def _pipelined_shared(kernel, pointers: dict) -> int:
    """Shared memory of the sm_90 build at K = 2048: a pipelined loop holds all its stages
    there."""
    return _shared(kernel, pointers, dict(AOT_CASES["plain_m16"], PDL=True),
                        {"num_warps": 4, "num_stages": 5})


def _shared(kernel, pointers: dict, consts: dict, options: dict, target: str = "sm_90") -> int:
    """Shared memory of ``target``'s build with the divisibility the JIT gives real shapes (K,
    N and the split length multiples of 16)."""
    import triton
    from triton.compiler import ASTSource

    from dspark_compile.kernels.targets import gpu_target

    signature = {a: "constexpr" if a in consts else "*" + pointers[a] if a in pointers
                 else "fp32" if a == "eps" else "i32" for a in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if a in pointers or a.startswith("stride_") or a in ("n", "k", "k_per_split")}
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=gpu_target(target), options=options).metadata.shared


def test_sm90_build_waits_then_reads(compiled: dict) -> None:
    """With PDL (sm_90): the wait for the previous kernel comes before every global load and
    atomic (kernels/pdl.py's contract)."""
    at = compiled["pdl_ptx"]
    assert all(at[op] >= 0 for op in at if op != "cp.async.c"), at
    assert at["griddepcontrol.wait"] < at["griddepcontrol.launch_dependents"]
    reads = [at["ld.global"], at["atom.global"]] + [at["cp.async.c"]] * (at["cp.async.c"] >= 0)
    assert at["griddepcontrol.wait"] < min(reads)


def test_sm90_build_with_a_settled_weight_loads_it_before_the_wait(compiled: dict) -> None:
    """``EARLY_W``: the first weight tile's loads come before the PDL wait; no store or
    atomic does."""
    at = compiled["pdl_ptx_early"]
    assert min(at.values()) >= 0, at
    assert at["ld.global"] < at["griddepcontrol.wait"] < min(at["st.global"], at["atom.global"])


def test_fp16_rotation_rounds_each_product(compiled: dict) -> None:
    """With the launch's options the fp16 rotation is half-precision multiplies and subtracts,
    each rounded; with fp fusion on, the compiler contracts them into ``fma.f16`` (one rounding
    fewer than the reference's, one ulp off on the H200)."""
    ops = compiled["rope_fp16_ptx"]
    assert ops[r"\bfma\.\S*f16"] == 0 and ops[r"\bmul\.rn\.f16"] > 0, ops


@pytest.mark.parametrize("target", PLAN_TARGETS)
def test_every_planned_launch_fits_the_targets_shared_memory(compiled: dict, target: str) -> None:
    """The plans' builds ask for at most the target's ``max_shared`` (a launch asking more fails
    with OutOfResources). On sm_90, without a prologue the early tile costs a buffer of one more
    stage: at 256-column tiles that build asked 278,528 bytes, so the plan drops the early tile
    there. On AMD the 210 KB pipeline budget asked 135-164 KB of gfx942's 64 KB and 175-215 KB
    of gfx950's 160 KB, so those entries' budgets are their LDS and the plan cuts ``BLOCK_K``."""
    from dspark_compile.kernels.targets import TARGETS

    limit = TARGETS[target].max_shared
    sizes = compiled["plan_shared_bytes"][target]
    assert all(b <= limit for b in sizes.values()), sizes


def test_plan_keeps_the_early_tile_only_where_its_buffer_fits() -> None:
    from dspark_compile.kernels.skinny import plan_skinny
    from dspark_compile.kernels.targets import TARGETS

    cfg = TARGETS["sm_90"]
    # no prologue, heads of 256: 3 stages of (256 + 16) x 128 tiles, one more would pass 227 KB
    plain = plan_skinny(3, 10752, 3584, cfg, 132, rot_d=256, staged_x=True, early_w=True)
    assert plain.block_n == 256 and plain.num_stages == 3 and not plain.early_w
    # with the norm in the prologue the activation tiles are not staged: the tile stays early
    assert plan_skinny(3, 10752, 3584, cfg, 132, rms=True, rot_d=256, early_w=True).early_w
    # gate/up without a prologue: 6 buffers of (128 + 16) x 128 fit (221,184 bytes)
    assert plan_skinny(3, 16384, 4096, cfg, 132, glu_out=True, staged_x=True,
                       early_w=True).early_w
    assert not plan_skinny(3, 16384, 4096, cfg, 132, glu_out=True, staged_x=True).early_w


def test_plan_cuts_the_k_tile_to_fit_a_small_lds() -> None:
    from dspark_compile.kernels.skinny import plan_skinny
    from dspark_compile.kernels.targets import TARGETS

    cfg = TARGETS["gfx942"]  # 64 KB: two stages of (2 x 64 + 16) x 128 do not fit, x 64 do
    plan = plan_skinny(3, 16384, 4096, cfg, 304, glu_out=True, staged_x=True)
    assert plan.block_k == 64 and (2 * 64 + 16) * 64 * 2 * plan.num_stages <= 64 * 1024
    assert plan.k_per_split % plan.block_k == 0
    # heads of 256 in the epilogue: whole heads a tile, so the K tile goes down to 32
    assert plan_skinny(3, 10752, 3584, cfg, 304, rot_d=256, staged_x=True).block_k == 32
    # a K tile asked for is kept (the benchmark's sweep); only the stages are cut
    asked = plan_skinny(3, 16384, 4096, cfg, 304, glu_out=True, block_k=128)
    assert asked.block_k == 128 and asked.num_stages == 2
    # sm_90 plans keep the table's tile
    assert plan_skinny(3, 16384, 4096, TARGETS["sm_90"], 132, glu_out=True).block_k == 128


def test_k_loop_is_software_pipelined(compiled: dict) -> None:
    """5 stages of the 64 x 128 weight tile and the 128 x 16 activation tile (100 KB), not
    one: a change that stops Triton pipelining the loop would cost most of its speed."""
    assert compiled["pipelined_shared_bytes"] >= 5 * (64 + 16) * 128 * 2


compiled, test_kernel_compiles_ahead_of_time = aot_tests(__file__, [*AOT_CASES, "prologue_rms_res"])


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
