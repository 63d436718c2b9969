"""Compile ws_step.py's warp-specialized step kernel for sm_90 (run as a script by
test_ws_step_smoke.py, without TRITON_INTERPRET) at its measured configuration (16 x 512 weight
tiles, 8 ring slots, 8 consumer warps, 16 splits a KV head): the valid step, and a build
without the waits or the attention's work that records each phase's times, and the valid step
with the producer's L2 lookahead (256 KB a program, the ring's stress); prints one JSON
line: each build's shared memory and what its PTX holds."""

import json
import sys

from aot import REPO, ring_build, ws_ptx

sys.path.insert(0, str(REPO / "benchmarks"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import ws_step  # noqa: E402

BN, BK, STAGES, WARPS = 16, 512, 8, 8
layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
desc = f"tensordesc<bf16[{BN},{BK}],{layout!r}>"
kernel = ws_step._ws_step_kernel
ptrs = dict(tab_ptr="i64", act_ptr="bf16", counter_ptr="i32", err_ptr="i32", resid_ptr="bf16",
            gamma_ptr="bf16", kc_ptr="bf16", vc_ptr="bf16", bt_ptr="i32", cos_ptr="bf16",
            sin_ptr="bf16", part_ptr="fp32", ml_ptr="fp32", probe_ptr="i64", w_ptr="bf16")
out = {}


def build(wait, skip, probe, look, mma, hand_over):
    consts = dict(BN=BN, BK=BK, STAGES=STAGES, KSTEPS=max(ws_step.KS) // BK, WAIT=wait,
                  SPIN=ws_step.SPIN_MAX, CH=128, MS=16, NH=ws_step.HEADS, NKV=ws_step.KV_HEADS,
                  HD=ws_step.HEAD_DIM, PAGE=16, SKIP=skip, PROBE=probe,
                  HID=ws_step.HIDDEN, LOOK=look, MMA=mma, num_warps=WARPS, **hand_over)
    sig = {"d2k": desc, "d8k": desc, **{a: "*" + t for a, t in ptrs.items()},
           "eps": "fp32", "sm_scale": "fp32", **{a: "constexpr" for a in consts}}
    sig = {a: sig.get(a, "i32") for a in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if a in ptrs or a == "width"}
    return triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})


for name, wait, skip, probe, look, wrel, mma in (
        ("step", True, 0, False, 0, False, 0), ("free_probe", False, 1, True, 0, False, 0),
        ("step_look", True, 0, False, 256 * 1024, False, 0),
        ("step_wrel", True, 0, False, 0, True, 0), ("step_wrel_mma", True, 0, False, 0, True, 2),
        ("step_wrel_mma_b", True, 0, False, 0, True, 3)):
    compiled = ring_build(lambda h: build(wait, skip, probe, look, mma, h), STAGES, WARPS, wrel)
    out[name] = ws_ptx(compiled, ld_cg=r"ld\.global\.cg", acq_rel=r"\.acq_rel\.",
                       mma=r"mma\.sync", globaltimer=r"%globaltimer",
                       l2_prefetch=r"prefetch\.global\.L2")
print(json.dumps(out))
