"""Compile ws_chain.py's warp-specialized chain kernel for sm_90 (run as a script by
test_ws_chain_smoke.py, without TRITON_INTERPRET) at its measured configuration (16 x 512 weight
tiles, 8 ring slots, 8 consumer warps), with and without the waits, and with the layers' input
transforms; prints one JSON line: each
build's shared memory and what its PTX holds."""

import json
import sys

from aot import REPO, ring_build, ws_ptx

sys.path.insert(0, str(REPO / "benchmarks"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

import ws_chain  # noqa: E402

BN, BK, STAGES, WARPS = 16, 512, 8, 8
layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
desc = f"tensordesc<bf16[{BN},{BK}],{layout!r}>"
kernel = ws_chain._ws_chain_kernel
out = {}

def build(wait, layer, mma, look, hand_over):
    consts = dict(BN=BN, BK=BK, STAGES=STAGES, KSTEPS=max(ws_chain.KS) // BK, WAIT=wait,
                  SPIN=ws_chain.SPIN_MAX, MATH=True, LAYER=layer, MMA=mma, LOOK=look,
                  num_warps=WARPS, **hand_over)
    sig = {"d2k": desc, "d8k": desc, "tab_ptr": "*i64", "act_ptr": "*bf16",
           "counter_ptr": "*i32", "err_ptr": "*i32", "resid_ptr": "*bf16",
           "gamma_ptr": "*bf16", "w_ptr": "*bf16", "num_phases": "i32", "width": "i32", "hidden": "i32",
           "eps": "fp32", **{a: "constexpr" for a in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if a in ("tab_ptr", "act_ptr", "counter_ptr", "err_ptr", "resid_ptr", "gamma_ptr",
                      "w_ptr", "width", "hidden")}
    return triton.compile(GluonASTSource(fn=kernel, signature=sig, constexprs=consts,
                                         attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})


for wait, layer, mma, look, wrel in ((True, False, False, 0, False),
                                     (False, False, False, 0, False),
                                     (True, True, False, 0, False), (True, False, True, 0, False),
                                     (True, False, False, 128 * 1024, False),
                                     (True, False, False, 0, True), (True, False, True, 0, True),
                                     (True, False, 2, 0, True), (True, False, 3, 0, True)):
    compiled = ring_build(lambda h: build(wait, layer, mma, look, h), STAGES, WARPS, wrel)
    name = (f"wait{int(wait)}" + ("_layer" if layer else "")
            + (f"_mma{mma}" if mma >= 2 else "_mma" if mma else "")
            + ("_look" if look else "") + ("_wrel" if wrel else ""))
    out[name] = ws_ptx(compiled, rsqrt=r"rsqrt", ex2=r"ex2\.approx", mma=r"mma\.sync",
                       fma=r"fma\.rn\.f32", l2_prefetch=r"prefetch\.global\.L2")
print(json.dumps(out))
