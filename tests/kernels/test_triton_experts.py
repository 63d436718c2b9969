"""Triton lowering of ``dspark::experts_route / experts_up / experts_down`` against the
reference (``ops/experts_reference.py``), the vendor ``torch._grouped_mm`` path, and ahead-of-
time compiles for cuda:90, gfx942 and gfx950.

Kernel cases run under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, set by
conftest.py without a GPU) at odd shapes: experts that span several row tiles, padding rows,
ids outside ``[0, E)``, NaN in rows that route nowhere. GPU cases (``-m gpu``) run bf16 at
Qwen3-30B-A3B's expert shapes and check a CUDA-graph replay against eager bit for bit. The AOT
cases run this file as a script without the interpreter (tests/aot.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from aot import TARGET_NAMES, aot_tests, compile_kernel
from dspark_compile.ops import experts_reference as ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FP32_TOL = 1e-4 if INTERPRET or not torch.cuda.is_available() else 3e-3
"""float32 dots: exact-ish in the interpreter (numpy); on CUDA IEEE at torch's default matmul
precision, the target's TF32 where torch allows it (``device.fp32_dot_precision``)."""
needs_kernel_device = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                         reason="needs a GPU or TRITON_INTERPRET=1")


def _device() -> str:
    return "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def _routing(n: int, k: int, e: int, seed: int, hot: bool = False):
    """ids with some outside ``[0, E)``; ``hot``: every token's first choice is expert 0, so
    it spans several row tiles. ``query_start_loc`` leaves the last 3 rows as padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, e + 1, (n, k), generator=g)
    if hot:
        ids[:, 0] = 0
    qsl = torch.tensor([0, n // 2, n - 3], dtype=torch.int32)
    return ids.to(_device()), qsl.to(_device())


def _tensor(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(_device())


@needs_kernel_device
@pytest.mark.parametrize("n,k,e,hot", [(11, 3, 5, False), (50, 4, 130, False),
                                       (40, 2, 4, True), (1, 1, 1, False),
                                       (1100, 4, 130, False)])  # 138 blocks: 2 scan chunks
def test_route_equals_reference_bitwise(n, k, e, hot):
    from dspark_compile.kernels.experts import experts_route_triton

    ids, qsl = _routing(n, k, e, seed=n, hot=hot)
    for bound in (qsl, None):
        got = experts_route_triton(ids, bound, e)
        want = ref.route(ids, bound, e)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)


UP_CASES = [  # n, k, e, d, f (up columns), transposed, activation, bias, hot
    (11, 3, 5, 48, 80, False, "silu_glu", False, False),
    (40, 2, 4, 32, 64, False, "gelu_glu", True, True),    # expert 0 spans 3 row tiles
    (9, 2, 3, 40, 48, True, "gelu_tanh_glu", True, False),
    (9, 2, 3, 40, 72, True, "none", True, False),         # GPT-OSS: its gate runs after
]


@needs_kernel_device
@pytest.mark.parametrize("case", UP_CASES, ids=lambda c: f"{c[6]}-t{int(c[5])}-b{int(c[7])}")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.float16, 3e-3)])
def test_up_equals_reference(case, dtype, tol):
    from dspark_compile.kernels.experts import experts_up_triton

    n, k, e, d, f, transposed, activation, with_bias, hot = case
    ids, qsl = _routing(n, k, e, seed=1, hot=hot)
    order, offsets = ref.route(ids, qsl, e)
    x = _tensor(n, d, dtype=dtype, seed=2)
    x[n - 3:] = float("nan")  # padding rows: never read into a routed pair
    w = _tensor(e, *((d, f) if transposed else (f, d)), dtype=dtype, seed=3, scale=d ** -0.5)
    bias = _tensor(e, f, dtype=dtype, seed=4) if with_bias else None
    got = experts_up_triton(x, order, offsets, w, bias, transposed, activation)
    want = ref.up(x.float(), order, offsets, w.float(), None if bias is None else bias.float(),
                  transposed, activation)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got, experts_up_triton(x, order, offsets, w, bias, transposed,
                                              activation)), "two runs agree bit for bit"


@needs_kernel_device
@pytest.mark.parametrize("transposed,with_bias,weights_dtype", [
    (False, False, torch.float32), (True, True, torch.float16)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, FP32_TOL), (torch.float16, 3e-3)])
def test_down_equals_reference(transposed, with_bias, weights_dtype, dtype, tol):
    from dspark_compile.kernels.experts import experts_down_triton

    n, k, e, d, i = 13, 3, 5, 40, 48
    ids, qsl = _routing(n, k, e, seed=5)
    order, offsets = ref.route(ids, qsl, e)
    h = _tensor(n * k, i, dtype=dtype, seed=6)
    weights = _tensor(n, k, dtype=weights_dtype, seed=7).abs()
    weights[n - 3:] = float("inf")  # routing weights of padding rows: never multiplied
    w = _tensor(e, *((i, d) if transposed else (d, i)), dtype=dtype, seed=8, scale=i ** -0.5)
    bias = _tensor(e, d, dtype=dtype, seed=9) if with_bias else None
    got = experts_down_triton(h, order, offsets, weights, w, bias, transposed)
    want = ref.down(h.float(), order, offsets, weights.float(), w.float(),
                    None if bias is None else bias.float(), transposed)
    assert got.dtype == torch.promote_types(dtype, weights_dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[n - 3:], torch.zeros_like(got[n - 3:])), "padding comes out zero"


@needs_kernel_device
@pytest.mark.parametrize("transposed,with_bias,dtype,tol", [
    (False, False, torch.float32, FP32_TOL), (True, True, torch.float16, 3e-3)])
def test_down_with_64_pair_row_tiles_takes_the_wide_column_tile(transposed, with_bias, dtype,
                                                                 tol):
    """Over 64 pairs an expert: the plan's 64-pair row tiles and the down GEMM's wide column
    tile (``TargetConfig.experts_down_block_n_wide``), here with a partial last column tile."""
    from dspark_compile.kernels.device import device_target
    from dspark_compile.kernels.experts import experts_down_triton, plan_experts

    n, k, e, d, i = 100, 4, 3, 200, 40
    ids, qsl = _routing(n, k, e, seed=15, hot=True)
    order, offsets = ref.route(ids, qsl, e)
    cfg, _ = device_target(ids.device)
    assert plan_experts(n * k, e).block_m == 64
    assert d % cfg.experts_down_block_n_wide != 0 and cfg.experts_down_block_n_wide > 64
    h = _tensor(n * k, i, dtype=dtype, seed=16)
    weights = _tensor(n, k, dtype=dtype, seed=17).abs()
    w = _tensor(e, *((i, d) if transposed else (d, i)), dtype=dtype, seed=18, scale=i ** -0.5)
    bias = _tensor(e, d, dtype=dtype, seed=19) if with_bias else None
    got = experts_down_triton(h, order, offsets, weights, w, bias, transposed)
    want = ref.down(h.float(), order, offsets, weights.float(), w.float(),
                    None if bias is None else bias.float(), transposed)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert torch.equal(got[n - 3:], torch.zeros_like(got[n - 3:])), "padding comes out zero"


@needs_kernel_device
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3)])
def test_weights_through_a_tensor_descriptor_equal_reference(dtype, tol, monkeypatch):
    """``TargetConfig.experts_tma``: both GEMMs load weight tiles through a tensor descriptor
    over ``[E * rows, K]`` (K = 40 < BLOCK_K: the descriptor reads zeros past its end; the up
    GEMM's gate and up halves at their own rows; the down GEMM's 64-pair row tiles with the
    wide column tile), against the reference and against the pointer loads bit for bit."""
    import dataclasses

    from dspark_compile.kernels import experts as kx

    cfg, sms = kx.device_target(torch.device(_device()))
    n, k, e, d, f = 100, 4, 3, 40, 128
    ids, qsl = _routing(n, k, e, seed=21, hot=True)
    order, offsets = ref.route(ids, qsl, e)
    x = _tensor(n, d, dtype=dtype, seed=22)
    w_up = _tensor(e, 2 * f, d, dtype=dtype, seed=23, scale=d ** -0.5)
    w_down = _tensor(e, 2 * f, f, dtype=dtype, seed=24, scale=f ** -0.5)
    weights = _tensor(n, k, dtype=dtype, seed=25).abs()
    assert kx.plan_experts(n * k, e).block_m == 64

    def layer(tma: bool):
        picked = dataclasses.replace(cfg, experts_tma=tma)
        monkeypatch.setattr(kx, "device_target", lambda device: (picked, sms))
        assert kx._tma_weights(w_up, False, f, picked.experts_block_n, picked) == tma
        assert kx._tma_weights(w_down, False, 2 * f, picked.experts_down_block_n_wide,
                               picked) == tma
        h = kx.experts_up_triton(x, order, offsets, w_up, None, False, "silu_glu")
        return h, kx.experts_down_triton(h, order, offsets, weights, w_down, None, False)

    h, got = layer(True)
    want_h = ref.up(x.float(), order, offsets, w_up.float(), None, False, "silu_glu")
    torch.testing.assert_close(h.float(), want_h, atol=tol, rtol=tol)
    want = ref.down(h.float(), order, offsets, weights.float(), w_down.float(), None, False)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    h_ptr, got_ptr = layer(False)
    assert torch.equal(h, h_ptr) and torch.equal(got, got_ptr), "same values as pointer loads"


def test_tensor_descriptor_only_where_the_weights_allow_it():
    import dataclasses

    from dspark_compile.kernels import experts as kx
    from dspark_compile.kernels.targets import TARGETS

    cfg = dataclasses.replace(TARGETS["sm_90"], experts_tma=True)
    w = torch.zeros(4, 128, 48, dtype=torch.bfloat16)
    assert kx._tma_weights(w, False, 64, 64, cfg)
    assert not kx._tma_weights(w, True, 64, 64, cfg), "transposed: K is not the inner dim"
    assert not kx._tma_weights(w, False, 96, 64, cfg), "a column tile would cross into the up half"
    assert not kx._tma_weights(w[:, :, :47], False, 64, 64, cfg), "not contiguous"
    assert not kx._tma_weights(torch.zeros(4, 128, 12, dtype=torch.bfloat16), False, 64, 64,
                               cfg), "K rows of 24 bytes: not a multiple of 16"
    assert not kx._tma_weights(w, False, 64, 64, dataclasses.replace(cfg, experts_tma=False))
    assert not kx._tma_weights(w.float(), False, 64, 64, cfg), "float32: pointer loads"
    assert TARGETS["sm_90"].experts_tma and not TARGETS["sm_80"].experts_tma, "TMA: sm_90 on"
    assert not any(TARGETS[t].experts_tma for t in ("gfx942", "gfx950"))


def test_vendor_grouped_mm_path_equals_reference():
    """``torch._grouped_mm`` (CPU kernel here, bf16 CUTLASS on the GPU) on 16-byte rows."""
    from dspark_compile.kernels.experts import _down_grouped_mm, _up_grouped_mm

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    n, k, e, d, i = 11, 2, 4, 64, 32
    ids, qsl = _routing(n, k, e, seed=10)
    ids, qsl = ids.cpu(), qsl.cpu()
    order, offsets = ref.route(ids, qsl, e)
    x = torch.randn(n, d)
    w = torch.randn(e, 2 * i, d) / d ** 0.5
    bias = torch.randn(e, 2 * i)
    got = _up_grouped_mm(x, order, offsets, w, bias, False, "silu_glu",
                         torch.empty(n * k, i))
    torch.testing.assert_close(got, ref.up(x, order, offsets, w, bias, False, "silu_glu"),
                               atol=1e-4, rtol=1e-4)
    h, wd, weights = torch.randn(n * k, i), torch.randn(e, i, d) / i ** 0.5, torch.rand(n, k)
    weights[n - 3:] = float("nan")
    got = _down_grouped_mm(h, order, offsets, weights, wd, None, True, torch.float32)
    torch.testing.assert_close(got, ref.down(h, order, offsets, weights, wd, None, True),
                               atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- GPU
QWEN3_30B = dict(e=128, k=8, d=2048, i=768)
"""Qwen3-30B-A3B's experts: 128 experts, top 8, hidden 2048, expert intermediate 768."""


def _layer(n: int, seed: int = 0, dtype=torch.bfloat16):
    e, k, d, i = QWEN3_30B.values()
    g = torch.Generator().manual_seed(seed)
    dev = "cuda"
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(dev)
    weights = torch.rand(n, k, generator=g).to(dtype).to(dev)
    x = torch.randn(n, d, generator=g).to(dtype).to(dev)
    w_up = (torch.randn(e, 2 * i, d, generator=g) * d ** -0.5).to(dtype).to(dev)
    w_down = (torch.randn(e, d, i, generator=g) * i ** -0.5).to(dtype).to(dev)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
    return ids, weights, x, w_up, w_down, qsl


def _experts(ids, weights, x, w_up, w_down, qsl):
    from dspark_compile.kernels import experts as kx

    order, offsets = kx.experts_route_triton(ids, qsl, w_up.shape[0])
    h = kx.experts_up_triton(x, order, offsets, w_up, None, False, "silu_glu")
    return kx.experts_down_triton(h, order, offsets, weights, w_down, None, False)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "triton_tma", "grouped_mm"])
@pytest.mark.parametrize("n", [3, 24, 192, 768])
def test_gpu_layer_equals_reference_and_replays_bitwise(n, kernel, monkeypatch):
    """Both choices of ``TargetConfig.experts_kernel`` on the device's own target entry, and
    the Triton GEMMs with ``experts_tma`` (weight tiles through tensor descriptors)."""
    import dataclasses

    from dspark_compile.kernels import experts as kx

    cfg, sms = kx.device_target(torch.device("cuda"))
    picked = dataclasses.replace(cfg, experts_kernel=kernel.split("_tma")[0],
                                 experts_tma=kernel.endswith("_tma"))
    monkeypatch.setattr(kx, "device_target", lambda device: (picked, sms))
    args = _layer(n)
    ids, weights, x, w_up, w_down, qsl = args
    eager = _experts(*args)
    order, offsets = ref.route(ids, qsl, w_up.shape[0])
    h = ref.up(x.float(), order, offsets, w_up.float(), None, False, "silu_glu")
    want = ref.down(h, order, offsets, weights.float(), w_down.float(), None, False)
    torch.testing.assert_close(eager.float(), want, atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _experts(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager), "graph replay equals eager bit for bit"


# --------------------------------------------------------------------------- ahead of time
AOT_CASES = {  # case -> (kernel, pointer dtypes, constexprs)
    "route_count": ("_route_count_kernel", dict(ids_ptr="i64", qsl_ptr="i32", hist_ptr="i32"),
                    dict(HAS_QSL=True, BLOCK_P=32, E_P2=256)),
    "route_scan": ("_route_scan_kernel", dict(hist_ptr="i32", totals_ptr="i32"),
                   dict(E_P2=256, BLOCK_E=64, BLOCK_B=128)),
    "route_place": ("_route_place_kernel",
                    dict(ids_ptr="i64", qsl_ptr="i32", before_ptr="i32", totals_ptr="i32",
                         order_ptr="i32", offsets_ptr="i32"),
                    dict(HAS_QSL=True, BLOCK_P=32, E_P2=256)),
    "up_bf16_silu": ("_experts_gemm_kernel", dict(a_ptr="bf16", w_ptr="bf16", bias_ptr="bf16",
                                                  scale_ptr="bf16", out_ptr="bf16"),
                     dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, E_P2=256, ACT=1, HAS_BIAS=False,
                          HAS_SCALE=False, DOT_PRECISION="ieee", W_EVICT="evict_first",
                          KEEP="evict_last", W_DESC=False)),
    "up_bf16_silu_tma": ("_experts_gemm_kernel",  # TargetConfig.experts_tma
                         dict(a_ptr="bf16", w_ptr="tensordesc<bf16[64,64]>", bias_ptr="bf16",
                              scale_ptr="bf16", out_ptr="bf16"),
                         dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, E_P2=256, ACT=1,
                              HAS_BIAS=False, HAS_SCALE=False, DOT_PRECISION="ieee",
                              W_EVICT="evict_first", KEEP="evict_last", W_DESC=True)),
    "down_bf16_bias_scale": ("_experts_gemm_kernel",
                             dict(a_ptr="bf16", w_ptr="bf16", bias_ptr="bf16",
                                  scale_ptr="fp32", out_ptr="fp32"),
                             dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, E_P2=256, ACT=0,
                                  HAS_BIAS=True, HAS_SCALE=True, DOT_PRECISION="ieee",
                                  W_EVICT="evict_first", KEEP="evict_last", W_DESC=False)),
    "down_bf16_wide": ("_experts_gemm_kernel",  # experts_down_block_n_wide's 64 x 128 tile
                       dict(a_ptr="bf16", w_ptr="bf16", bias_ptr="bf16", scale_ptr="bf16",
                            out_ptr="bf16"),
                       dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, E_P2=256, ACT=0,
                            HAS_BIAS=False, HAS_SCALE=True, DOT_PRECISION="ieee",
                            W_EVICT="", KEEP="", W_DESC=False)),
    "combine_bf16": ("_combine_kernel", dict(scratch_ptr="bf16", out_ptr="bf16"),
                     dict(TOP_K=8, BLOCK_T=8, BLOCK_D=256, READ_EVICT="evict_first")),
}


def _compile_all() -> dict:
    from dspark_compile.kernels import experts as triton_experts
    from dspark_compile.kernels.targets import TARGETS

    out: dict = {}
    for case, (name, pointers, consts) in AOT_CASES.items():
        kernel = getattr(triton_experts, name)
        pointers = {"order_ptr": "i32", "offsets_ptr": "i32", **pointers}
        pointers = {a: t for a, t in pointers.items() if a in kernel.arg_names}
        for target in TARGET_NAMES:
            cfg = TARGETS[target]
            opts = {"num_warps": cfg.experts_num_warps}
            if name == "_experts_gemm_kernel":
                opts["num_stages"] = cfg.experts_num_stages
            out.setdefault(case, {})[target] = compile_kernel(kernel, pointers, consts, target,
                                                              opts)
    return out


compiled, test_kernel_compiles_ahead_of_time = aot_tests(__file__, AOT_CASES)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "AOT compile needs TRITON_INTERPRET unset"
    print(json.dumps(_compile_all()))
