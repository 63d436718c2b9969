"""How fast does this GPU stream a layer's KV bytes? The best read rate of a plain Triton
streaming kernel (each program sums its grid-stride share of a buffer) over a few tile shapes,
and a device-to-device copy for comparison, each in CUDA-graph replays that cycle over 16
buffers (so nothing is served from L2).

Each buffer holds one layer's KV at the verify benchmark's bs 64 (64 requests x 1024 keys x 8 KV
heads x 128 x K and V, bf16: 268 MB), so the time per call is that layer's KV-read floor at the
rate this machine reaches, against the 4.8 TB/s of the step's floor.

    python benchmarks/hbm_read.py    # writes hbm_read.json to $OUT or benchmarks/results/
    python benchmarks/hbm_read.py --paged   # the attention's paged pattern: hbm_read_paged.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from attention_kernel import page_table
from common import time_calls

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


@triton.jit
def _paged_read_kernel(k_ptr, v_ptr, bt_ptr, out_ptr, pages_per_req, stride_page, stride_row,
                       stride_head, HKV: tl.constexpr, TILE: tl.constexpr, PAGE: tl.constexpr,
                       D: tl.constexpr):
    """One (request, KV head) program reads its K and V rows page by page through the block
    table, TILE keys a step, as the attention's context loop does; writes a checksum."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_n = tl.arange(0, TILE)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([TILE, D], tl.float32)
    pos = offs_n
    page = tl.load(bt_ptr + req * pages_per_req + pos // PAGE).to(tl.int64)
    for t in range(0, pages_per_req * PAGE // TILE):
        rows = page * stride_page + (pos % PAGE) * stride_row + head * stride_head
        pos = (t + 1) * TILE + offs_n  # the next tile's pages, one step ahead
        page = tl.load(bt_ptr + req * pages_per_req + pos // PAGE,
                       mask=pos < pages_per_req * PAGE, other=0).to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + rows[:, None] + offs_d[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + (req * HKV + head) * D + offs_d, tl.sum(acc, 0))


@triton.jit
def _paged_dots_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, out_ptr, pages_per_req,
                       stride_page, stride_row, stride_head, HKV: tl.constexpr,
                       TILE: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                       TMA: tl.constexpr):
    """The attention's loop without its softmax: per (request, KV head), ``acc += (q @ K.T)
    @ V`` over the request's pages, K/V tiles loaded by pointers (``TILE`` keys a step) or,
    with ``TMA``, one page a step through tensor descriptors over ``[pages * page, Hkv * D]``."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + tl.arange(0, 16)[:, None] * D + offs_d[None, :])
    acc = tl.zeros([16, D], tl.float32)
    if TMA:
        for p in range(0, pages_per_req):
            page = tl.load(bt_ptr + req * pages_per_req + p)
            k = k_desc.load([page * PAGE, head * D])
            v = v_desc.load([page * PAGE, head * D])
            s = tl.dot(q, tl.trans(k))
            acc = tl.dot(s.to(v.dtype), v, acc)
    else:
        offs_n = tl.arange(0, TILE)
        pos = offs_n
        page = tl.load(bt_ptr + req * pages_per_req + pos // PAGE).to(tl.int64)
        for t in range(0, pages_per_req * PAGE // TILE):
            rows = page * stride_page + (pos % PAGE) * stride_row + head * stride_head
            pos = (t + 1) * TILE + offs_n
            page = tl.load(bt_ptr + req * pages_per_req + pos // PAGE,
                           mask=pos < pages_per_req * PAGE, other=0).to(tl.int64)
            k = tl.load(k_ptr + rows[:, None] + offs_d[None, :])
            v = tl.load(v_ptr + rows[:, None] + offs_d[None, :])
            s = tl.dot(q, tl.trans(k))
            acc = tl.dot(s.to(v.dtype), v, acc)
    tl.store(out_ptr + ((req * HKV + head) * 16 + tl.arange(0, 16))[:, None] * D
             + offs_d[None, :], acc)


PAGED = dict(requests=64, context=1024, page=16, kv_heads=8, head_dim=128)
DOTS_CONFIGS = ((False, 32, 4, 3), (True, 16, 4, 3), (True, 16, 4, 4), (True, 16, 4, 6),
                (True, 16, 8, 4))
PAGED_TILES = ((32, 4, 3), (32, 4, 4), (64, 4, 3), (64, 8, 3))
PAGE_ORDERS = ("shuffled", "in_order", "runs:4", "runs:16")
"""How the pool's pages fall in each request's block table (``attention_kernel.page_table``):
the rows above read a shuffled pool; these time the first and third tiles over each order."""


def paged(dev, sms: int) -> dict:
    """The attention's access pattern at bs 64: pools ``[pages, page, Hkv, D]`` (this
    project's layout: a (page, head) is 16 rows of 256 B, 2 KB apart) against ``[pages, Hkv,
    page, D]`` (each (page, head) 4 KB in one piece), pages in a random order; then this
    project's layout over each of :data:`PAGE_ORDERS`."""
    r, ctx, pg, hkv, d = (PAGED[k] for k in ("requests", "context", "page", "kv_heads",
                                             "head_dim"))
    per_req = ctx // pg
    pages = r * per_req
    gen = torch.Generator().manual_seed(0)
    tables = {order: page_table(r, per_req, order, gen).to(torch.int32).to(dev)
              for order in PAGE_ORDERS}
    bt = tables["shuffled"]
    pools = [(torch.randn(pages, pg, hkv, d, device=dev, dtype=torch.bfloat16),
              torch.randn(pages, pg, hkv, d, device=dev, dtype=torch.bfloat16))
             for _ in range(BUFFERS)]
    out = torch.empty(r * hkv * d, device=dev, dtype=torch.float32)
    layouts = {"page_row_head": (pg * hkv * d, hkv * d, d),  # [pages, page, Hkv, D]
               "page_head_row": (hkv * pg * d, d, pg * d)}  # [pages, Hkv, page, D]
    rows = []
    for name, strides in layouts.items():
        for tile, warps, stages in PAGED_TILES:
            def read(k, v, tile=tile, warps=warps, stages=stages, strides=strides):
                _paged_read_kernel[(r, hkv)](k, v, bt, out, per_req, *strides, HKV=hkv,
                                             TILE=tile, PAGE=pg, D=d, num_warps=warps,
                                             num_stages=stages)

            us = time_calls([lambda k=k, v=v, f=read: f(k, v) for k, v in pools], TIMING,
                            "cuda")["graph_us"]
            rows.append({"layout": name, "tile": tile, "warps": warps, "stages": stages,
                         "us": us, "bytes_per_s": LAYER_KV_BYTES / (us * 1e-6)})
            print(rows[-1], flush=True)
    orders = []  # this project's layout, the first tiles, each page order
    for order, table in tables.items():
        for tile, warps, stages in PAGED_TILES[:3:2]:
            def read(k, v, tile=tile, warps=warps, stages=stages, table=table):
                _paged_read_kernel[(r, hkv)](k, v, table, out, per_req,
                                             *layouts["page_row_head"], HKV=hkv, TILE=tile,
                                             PAGE=pg, D=d, num_warps=warps, num_stages=stages)

            us = time_calls([lambda k=k, v=v, f=read: f(k, v) for k, v in pools], TIMING,
                            "cuda")["graph_us"]
            orders.append({"order": order, "tile": tile, "warps": warps, "stages": stages,
                           "us": us, "bytes_per_s": LAYER_KV_BYTES / (us * 1e-6)})
            print(orders[-1], flush=True)
    from triton.tools.tensor_descriptor import TensorDescriptor

    q = torch.randn(16, d, device=dev, dtype=torch.bfloat16) * 0.05
    acc_out = torch.empty(r * hkv * 16, d, device=dev, dtype=torch.float32)
    strides = layouts["page_row_head"]
    descs = [(TensorDescriptor.from_tensor(k.view(pages * pg, hkv * d), [pg, d]),
              TensorDescriptor.from_tensor(v.view(pages * pg, hkv * d), [pg, d]))
             for k, v in pools]
    k0, v0 = (t[bt.long()].permute(0, 3, 1, 2, 4).reshape(r, hkv, per_req * pg, d).float()
              for t in pools[0])  # [R, Hkv, keys, D] in block-table order
    s0 = (q.float() @ k0.transpose(-1, -2)).to(torch.bfloat16).float()
    want = (s0 @ v0).reshape(r * hkv * 16, d)
    dots = []
    for tma, tile, warps, stages in DOTS_CONFIGS:
        def run(i, tma=tma, tile=tile, warps=warps, stages=stages):
            _paged_dots_kernel[(r, hkv)](q, *pools[i], *descs[i], bt, acc_out, per_req,
                                         *strides, HKV=hkv, TILE=tile, PAGE=pg, D=d, TMA=tma,
                                         num_warps=warps, num_stages=stages)

        run(0)
        ref = acc_out.clone()
        run(0)
        repeatable = bool(torch.equal(ref, acc_out))  # before the timing overwrites it
        err = (ref - want).abs().max().item()
        us = time_calls([lambda i=i, f=run: f(i) for i in range(len(pools))], TIMING,
                        "cuda")["graph_us"]
        dots.append({"tma": tma, "tile": tile, "warps": warps, "stages": stages, "us": us,
                     "bytes_per_s": LAYER_KV_BYTES / (us * 1e-6), "repeatable": repeatable,
                     "max_abs_err": err})
        print(dots[-1], flush=True)
    return {"settings": PAGED, "programs": r * hkv, "sm_count": sms, "rows": rows,
            "page_orders": orders, "dots": dots}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paged", action="store_true",
                    help="the attention's paged access pattern in two pool layouts instead "
                         "(hbm_read_paged.json)")
    opts = ap.parse_args()
    dev = torch.device("cuda")
    if opts.paged:
        report = {"environment": {"gpu": torch.cuda.get_device_name(),
                                  "torch": torch.__version__, "triton": triton.__version__,
                                  "timing": TIMING,
                                  "command": "python benchmarks/hbm_read.py --paged"},
                  "layer_kv_bytes": LAYER_KV_BYTES,
                  **paged(dev, torch.cuda.get_device_properties(dev).multi_processor_count)}
        out = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
        out.mkdir(parents=True, exist_ok=True)
        (out / "hbm_read_paged.json").write_text(json.dumps(report, indent=1))
        return
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
