"""How fast does this GPU stream a layer's KV bytes? The best read rate of a plain Triton
streaming kernel (each program sums its grid-stride share of a buffer) over a few tile shapes,
and a device-to-device copy for comparison, each in CUDA-graph replays that cycle over 16
buffers (so nothing is served from L2).

Each buffer holds one layer's KV at the verify benchmark's bs 64 (64 requests x 1024 keys x 8 KV
heads x 128 x K and V, bf16: 268 MB), so the time per call is that layer's KV-read floor at the
rate this machine reaches, against the 4.8 TB/s of the step's floor.

    python benchmarks/hbm_read.py    # writes hbm_read.json to $OUT or benchmarks/results/
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from timing import time_calls

LAYER_KV_BYTES = 64 * 1024 * 8 * 128 * 2 * 2
BUFFERS = 16
DATASHEET_BYTES_PER_S = 4.8e12
TILES = ((4096, 4), (8192, 8), (16384, 8), (16384, 16))
PROGRAMS_PER_SM = (1, 2, 4, 8)
TIMING = dict(eager_iters=32, graph_calls=16, graph_replays=10)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[pid]`` <- the sum of this program's blocks of ``x`` (grid-stride)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, step):
        idx = start + offs
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = LAYER_KV_BYTES // 2
    bufs = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(BUFFERS)]
    rows = []
    for block, warps in TILES:
        for per_sm in PROGRAMS_PER_SM:
            grid = sms * per_sm
            out = torch.empty(grid, device=dev, dtype=torch.float32)

            def read(x, block=block, warps=warps, grid=grid, out=out):
                _read_kernel[(grid,)](x, out, n, BLOCK=block, num_warps=warps)

            read(bufs[0])
            ok = abs(out.sum().item() - bufs[0].float().sum().item()) < 1e-2 * n ** 0.5
            us = time_calls([lambda x=x, f=read: f(x) for x in bufs], TIMING, "cuda")["graph_us"]
            rows.append({"block": block, "warps": warps, "programs": grid, "sum_ok": ok,
                         "us": us, "bytes_per_s": LAYER_KV_BYTES / (us * 1e-6)})
            print(rows[-1], flush=True)
    best = min(rows, key=lambda r: r["us"])
    dst = torch.empty_like(bufs[0])
    copy_us = time_calls([lambda x=x: dst.copy_(x) for x in bufs], TIMING, "cuda")["graph_us"]
    report = {
        "environment": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "triton": triton.__version__, "sm_count": sms, "timing": TIMING,
                        "command": "python benchmarks/hbm_read.py"},
        "layer_kv_bytes": LAYER_KV_BYTES, "buffers": BUFFERS,
        "read": rows, "best_read": best,
        "copy_us": copy_us, "copy_bytes_per_s": 2 * LAYER_KV_BYTES / (copy_us * 1e-6),
        "datasheet_layer_us": LAYER_KV_BYTES / DATASHEET_BYTES_PER_S * 1e6,
        "best_read_share_of_datasheet": best["bytes_per_s"] / DATASHEET_BYTES_PER_S,
    }
    print({k: v for k, v in report.items() if k != "read"}, flush=True)
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "hbm_read.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
