"""Does compiling Triton kernels on a thread pool shorten a cold start? Compiles K variants of a
tiled matmul kernel (K distinct constexpr values, so K real compiles) one after another, then K
other variants through ``triton.runtime._async_compile.AsyncCompileMode`` on a thread pool of
``--workers`` threads (``JITFunction.warmup``: compile, no launch), each half from an empty
Triton cache, and reports the wall time of each.

    python benchmarks/jit_parallel.py [--variants 16] [--workers 16]

Writes ``jit_parallel.json`` to ``$OUT`` (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="jit_parallel_"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _mm_kernel(a, b, c, M, N, K, VID: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(b + (k + rk)[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
    acc = acc * (1.0 + VID * 1e-6)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _warm(vid: int, a, b, c) -> None:
    _mm_kernel.warmup(a, b, c, 256, 256, 256, VID=vid, BM=64, BN=128, BK=64, num_stages=3,
                      num_warps=4, grid=(1,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=int, default=16)
    ap.add_argument("--workers", type=int, default=16)
    opts = ap.parse_args()
    from triton.runtime._async_compile import AsyncCompileMode

    a = torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda")
    b, c = torch.zeros_like(a), torch.zeros_like(a)
    _warm(-1, a, b, c)  # the compiler's own first-use costs, outside both timings
    k = opts.variants
    t0 = time.perf_counter()
    for v in range(k):
        _warm(v, a, b, c)
    serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(opts.workers) as pool, AsyncCompileMode(pool):
        for v in range(k, 2 * k):
            _warm(v, a, b, c)
        submitted = time.perf_counter() - t0
    threaded = time.perf_counter() - t0
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "cpus": os.cpu_count(), "variants": k,
           "workers": opts.workers, "serial_s": serial, "threaded_s": threaded,
           "threaded_submit_s": submitted, "speedup": serial / threaded,
           "command": f"python benchmarks/jit_parallel.py --variants {k} --workers "
                      f"{opts.workers}"}
    print(json.dumps(row, indent=1))
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "jit_parallel.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
