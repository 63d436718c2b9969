"""Do TMA loads of lines an L2 prefetch brought in return the memory's bytes?

Each program copies its ``[16, 512]`` tiles of a 1 GB bf16 buffer through shared memory (a TMA
load, then plain stores to ``out``), first prefetching the tile ``D`` of its tiles ahead (``D``
0: the tile itself) by ``prefetch.global.L2`` (``PF`` 1, a line a thread) or
``cp.async.bulk.prefetch.L2`` (``PF`` 2). ``out`` must equal the buffer bit for bit; the
mismatched elements of each run are written to ``tma_after_prefetch.json``. A check made while
finding why ``ws_chain`` / ``ws_step`` gave a different output each step under line prefetches
(the slot release, not the TMA: docs/benchmarks.md).

    python benchmarks/tma_after_prefetch.py

Needs an sm_90 GPU.
"""
import json
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_sync = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _copy(desc, w_ptr, out_ptr, ntiles, K: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
          D: gl.constexpr, PF: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BK], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    LL: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    line = gl.arange(0, 32 * num_warps, layout=LL)  # BN * BK / 64 lines a tile
    ri = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    ci = gl.arange(0, BK, layout=gl.SliceLayout(0, L))
    per_row: gl.constexpr = K // BK
    phase = 0
    for t in range(pid, ntiles, nprog):
        if PF != 0:
            t2 = t + D * nprog
            if t2 < ntiles:
                a = (w_ptr + ((t2 // per_row) * BN + line // (BK // 64)).to(gl.int64) * K
                     + (t2 % per_row) * BK + (line % (BK // 64)) * 64)
                if PF == 1:
                    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                              "=r,l", [a], dtype=gl.int32, is_pure=False, pack=1)
                else:
                    gl.inline_asm_elementwise(
                        "cp.async.bulk.prefetch.L2.global [$1], 128;\n\tmov.u32 $0, 0;", "=r,l",
                        [a], dtype=gl.int32, is_pure=False, pack=1)
        r0 = (t // per_row) * BN
        c0 = (t % per_row) * BK
        mbarrier.expect(bar, BN * BK * 2)
        _tma_load(desc, [r0, c0], bar, smem)
        mbarrier.wait(bar, phase)
        phase ^= 1
        v = smem.load(L)
        gl.store(out_ptr + (r0 + ri).to(gl.int64)[:, None] * K + c0 + ci[None, :], v)
        _sync()  # every warp has read the tile before the next load


def main():
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    K, BN, BK = 2048, 16, 512
    rows = (1 << 29) // K  # 1 GB of bf16
    g = torch.Generator(dev).manual_seed(0)
    w = torch.randn(rows, K, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty_like(w)
    layout = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    desc = TensorDescriptor(w, [rows, K], [K, 1], [BN, BK], layout)
    ntiles = rows // BN * (K // BK)
    res = []
    for pf, d in [(0, 0), (1, 0), (1, 1), (1, 4), (1, 16), (1, 64), (2, 0), (2, 4), (2, 16)]:
        bad = []
        for _ in range(5):
            out.fill_(0)
            _copy[(sms,)](desc, w, out, ntiles, K=K, BN=BN, BK=BK, D=d, PF=pf, num_warps=4)
            torch.cuda.synchronize()
            diff = (out.view(torch.int16) != w.view(torch.int16))
            bad.append(int(diff.sum().item()))
        row = dict(pf=pf, d=d, mismatched_elements=bad)
        print(json.dumps(row), flush=True)
        res.append(row)
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, results=res),
              open(os.path.join(os.environ.get("OUT", "."), "tma_after_prefetch.json"), "w"),
              indent=1)
    if any(sum(r["mismatched_elements"]) for r in res):
        raise SystemExit("a TMA load returned bytes other than the memory's")


if __name__ == "__main__":
    main()
