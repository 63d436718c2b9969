"""Spike: the bs-1 step's matmul chain as one persistent launch with grid barriers, against the
same chain as one skinny launch a matmul (today's lowering) and a plain read of the same bytes.

Issue 27's small-batch target needs the step's weights streamed at >= 85% of HBM through 65
matmuls a step (16 layers x q+k+v, o, gate+up, down, then the LM head of the 1.1B Llama-like
model). Each launch boundary drains the memory pipe. Weights never depend on the activations, so a
persistent kernel can keep streaming them across the dependency between two matmuls: every
program loads its first weight tile of the next matmul, then waits at a grid barrier (an
atomic counter) for the activations the previous matmul wrote.

Measured here, one process, graph replays (ms a chain):
- ``read``: ``hbm_read.py``'s streaming kernel over the chain's weight bytes (the ceiling);
- ``skinny``: ``skinny_linear_triton`` a matmul, PDL and the early first tile as in the step;
- ``persistent``: this file's kernel, with and without the prefetch before each barrier, and
  without the barriers (``free``: the matmuls' data dependency dropped; not a valid chain, the
  stream rate the kernel reaches when nothing waits).
Every chain is checked against a float32-accumulated torch chain of the same roundings.

The activations here are the matmuls' outputs fed straight into the next one (its first K
values of the flattened output; no attention, norm or SiLU): a spike of the streaming, not a
verify step.

    python benchmarks/persistent_spike.py [--rows 3] [--smoke]

``--smoke`` runs three small phases on the CPU under ``TRITON_INTERPRET=1`` with one program (its
barriers pass trivially) against the torch chain. Writes ``persistent_spike.json`` to ``$OUT`` or
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read when @triton.jit decorates
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROWS_PAD = 16  # the activation tile's rows (the dot's narrow side)
BLOCK_M = tl.constexpr(ROWS_PAD)
LAYER = ((4096, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # (N, K): qkv, o, gate+up, down
LM_HEAD = (32000, 2048)
SPIN_MAX = 1 << 18
TIMING = dict(eager_iters=3, graph_calls=1, graph_replays=20)  # common.time_calls's settings
SKINNY_SWEEP = [dict(num_warps=8), dict(num_warps=8, block_k=256, num_stages=4),
                dict(num_warps=8, block_n=128), dict(num_warps=4, block_k=256, num_stages=4),
                dict(num_warps=2), dict(num_warps=8, block_n=128, block_k=256, num_stages=3),
                dict(num_warps=4, block_n=128), dict(num_warps=4, num_stages=8),
                dict(num_warps=4, tma=True)]
"""``--skinny-sweep``: ``skinny_linear_triton`` tile overrides (every matmul of the chain)."""


@triton.jit
def _wait(counter_ptr, target, err_ptr, SPIN: tl.constexpr):
    """Spin until the counter reaches ``target`` (acquire), then sync the program's threads; a
    wait past ``SPIN`` polls sets ``err`` and gives up instead of hanging the GPU."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < SPIN):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        spins += 1
    if spins >= SPIN:
        tl.store(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def _phase(tab_ptr, p):
    """Phase ``p``'s row of the table: ``(w_off, n, k, in_off, out_off)``. Its values are
    multiples of 256 (``Chain`` checks); said so, the loads are 16-byte vectors, which the
    pipeliner needs for its asynchronous copies."""
    w_off = tl.multiple_of(tl.load(tab_ptr + p * 5), 256)
    n = tl.multiple_of(tl.load(tab_ptr + p * 5 + 1).to(tl.int32), 256)
    k = tl.multiple_of(tl.load(tab_ptr + p * 5 + 2).to(tl.int32), 256)
    in_off = tl.multiple_of(tl.load(tab_ptr + p * 5 + 3), 256)
    out_off = tl.multiple_of(tl.load(tab_ptr + p * 5 + 4), 256)
    return w_off, n, k, in_off, out_off


@triton.jit
def _tile(w_ptr, act_ptr, w_off, in_off, out_off, t, n, k, k_start, acc, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """Column tile ``t`` of ``act_out[BLOCK_M, n] = act_in[BLOCK_M, k] @ w[n, k].T``: K from
    ``k_start`` onto ``acc [BLOCK_N, BLOCK_M]``, then the bf16 store."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    w_ptrs = w_ptr + w_off + offs_n[:, None].to(tl.int64) * k + (k_start + offs_k)[None, :]
    x_ptrs = act_ptr + in_off + offs_m[None, :] * k + (k_start + offs_k)[:, None]
    for _ in range(k_start, k, BLOCK_K):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs, cache_modifier=".cg")  # another program wrote it: not from L1
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = act_ptr + out_off + offs_m[None, :] * n + offs_n[:, None]
    tl.store(out, acc.to(act_ptr.dtype.element_ty))


@triton.jit
def _tile_gemv(w_ptr, act_ptr, w_off, in_off, out_off, t, n, k, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Column tile ``t`` for the first ``ROWS`` (<= 4) activation rows on the CUDA cores: each
    lane multiplies 8 consecutive weights by each row's 8 inputs and keeps one partial a row;
    the partials are summed once after the K loop."""
    VEC: tl.constexpr = 8
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [C, 8]
    w_ptrs = w_ptr + w_off + offs_n[:, None, None].to(tl.int64) * k + kk[None, :, :]
    x_ptrs = act_ptr + in_off + kk
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    for _ in range(0, k, BLOCK_K):
        w = tl.load(w_ptrs).to(tl.float32)
        acc0 += tl.sum(w * tl.load(x_ptrs, cache_modifier=".cg").to(tl.float32)[None], 2)
        if ROWS > 1:
            acc1 += tl.sum(w * tl.load(x_ptrs + k, cache_modifier=".cg").to(tl.float32)[None],
                           2)
        if ROWS > 2:
            acc2 += tl.sum(w * tl.load(x_ptrs + 2 * k,
                                       cache_modifier=".cg").to(tl.float32)[None], 2)
        if ROWS > 3:
            acc3 += tl.sum(w * tl.load(x_ptrs + 3 * k,
                                       cache_modifier=".cg").to(tl.float32)[None], 2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    ty = act_ptr.dtype.element_ty
    out = act_ptr + out_off + offs_n
    tl.store(out, tl.sum(acc0, 1).to(ty))
    if ROWS > 1:
        tl.store(out + n, tl.sum(acc1, 1).to(ty))
    if ROWS > 2:
        tl.store(out + 2 * n, tl.sum(acc2, 1).to(ty))
    if ROWS > 3:
        tl.store(out + 3 * n, tl.sum(acc3, 1).to(ty))


@triton.jit
def _phase_flat(w_ptr, act_ptr, w_off, in_off, out_off, first, step, n, k, w0,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """This program's column tiles ``first, first + step, ...`` of one phase as one loop over
    (tile, K step), so the pipeline runs through tile boundaries; the accumulator is stored and
    reset after a tile's last K step. With ``PREFETCH``, ``w0`` is the first tile's first
    weight step (loaded before the barrier)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    tiles = n // BLOCK_N
    k_steps = k // BLOCK_K
    count = tl.maximum(tiles - first + step - 1, 0) // step
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    start = 0
    if PREFETCH:
        if count > 0:
            x0 = tl.load(act_ptr + in_off + offs_m[None, :] * k + offs_k[:, None],
                         cache_modifier=".cg")
            acc = tl.dot(w0, x0, acc)
            start = 1
            if k_steps == 1:
                out = act_ptr + out_off + offs_m[None, :] * n + (first * BLOCK_N + offs_n)[:, None]
                tl.store(out, acc.to(act_ptr.dtype.element_ty))
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for i in range(start, count * k_steps):
        t = first + (i // k_steps) * step
        k0 = (i % k_steps) * BLOCK_K
        rows = (t * BLOCK_N + offs_n).to(tl.int64)
        w = tl.load(w_ptr + w_off + rows[:, None] * k + (k0 + offs_k)[None, :])
        x = tl.load(act_ptr + in_off + offs_m[None, :] * k + (k0 + offs_k)[:, None],
                    cache_modifier=".cg")
        acc = tl.dot(w, x, acc)
        if i % k_steps == k_steps - 1:
            out = act_ptr + out_off + offs_m[None, :] * n + (t * BLOCK_N + offs_n)[:, None]
            tl.store(out, acc.to(act_ptr.dtype.element_ty))
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)


@triton.jit
def _chain_kernel(w_ptr, act_ptr, tab_ptr, counter_ptr, err_ptr, num_phases,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                  BARRIER: tl.constexpr, SPIN: tl.constexpr, FLAT: tl.constexpr,
                  GEMV_ROWS: tl.constexpr):
    """Every phase of the table in order; program ``pid`` takes column tiles ``pid, pid +
    programs, ...``; a grid barrier between phases (``BARRIER``); with ``PREFETCH`` the first
    weight tile of the next phase is loaded before the barrier."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for p in range(num_phases):
        w_off, n, k, in_off, out_off = _phase(tab_ptr, p)
        tiles = n // BLOCK_N
        first = pid
        rows = (first * BLOCK_N + offs_n).to(tl.int64)
        w0 = tl.zeros([BLOCK_N, BLOCK_K], w_ptr.dtype.element_ty)
        if PREFETCH:
            w0 = tl.load(w_ptr + w_off + rows[:, None] * k + offs_k[None, :],
                         mask=(rows < n)[:, None], other=0.0)
        if BARRIER:
            if p > 0:
                _wait(counter_ptr, p * nprog, err_ptr, SPIN)
        if GEMV_ROWS > 0:
            for t in range(first, tiles, nprog):
                _tile_gemv(w_ptr, act_ptr, w_off, in_off, out_off, t, n, k, BLOCK_N, BLOCK_K,
                           GEMV_ROWS)
        elif FLAT:
            _phase_flat(w_ptr, act_ptr, w_off, in_off, out_off, first, nprog, n, k, w0,
                        BLOCK_N, BLOCK_K, PREFETCH)
        elif PREFETCH:
            if first < tiles:
                offs_m = tl.arange(0, BLOCK_M)
                x0 = tl.load(act_ptr + in_off + offs_m[None, :] * k + offs_k[:, None],
                             cache_modifier=".cg")
                acc = tl.dot(w0, x0, tl.zeros([BLOCK_N, BLOCK_M], tl.float32))
                _tile(w_ptr, act_ptr, w_off, in_off, out_off, first, n, k, BLOCK_K, acc,
                      BLOCK_N, BLOCK_K)
            first += nprog
        if (not FLAT) & (GEMV_ROWS == 0):
            for t in range(first, tiles, nprog):
                _tile(w_ptr, act_ptr, w_off, in_off, out_off, t, n, k, 0,
                      tl.zeros([BLOCK_N, BLOCK_M], tl.float32), BLOCK_N, BLOCK_K)
        if BARRIER:
            tl.debug_barrier()  # every thread's stores issued before the arrival
            tl.atomic_add(counter_ptr, 1, sem="release")


def phases(layers: int) -> list[tuple[int, int]]:
    """The chain's (N, K): ``layers`` times the layer's four matmuls, then the LM head."""
    return [*LAYER] * layers + [LM_HEAD]


class Chain:
    """Weights (one flat bf16 buffer), the phase table and the ping-pong activations."""

    def __init__(self, shapes: list[tuple[int, int]], device: str, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        for i in range(1, len(shapes)):
            if shapes[i][1] > shapes[i - 1][0]:
                raise ValueError(f"phase {i} is N x K = {shapes[i][0]} x {shapes[i][1]} after "
                                 f"N = {shapes[i - 1][0]}: a phase reads its input from the last "
                                 "one's output, so its K may not exceed that N")
        g = torch.Generator(device).manual_seed(seed)
        self.shapes = shapes
        sizes = [n * k for n, k in shapes]
        self.w = torch.empty(sum(sizes), dtype=dtype, device=device)
        offs, o = [], 0
        for (n, k), size in zip(shapes, sizes):
            self.w[o:o + size].normal_(0.0, k ** -0.5, generator=g)
            offs.append(o)
            o += size
        width = max(max(n, k) for n, k in shapes)
        self.act = torch.zeros(2 * ROWS_PAD * width, dtype=dtype, device=device)
        half = ROWS_PAD * width
        rows = [(offs[i], n, k, (i % 2) * half, ((i + 1) % 2) * half)
                for i, (n, k) in enumerate(shapes)]
        if any(v % 256 for row in rows for v in row):
            raise ValueError(f"phase table {rows}: every offset and size must be a multiple of 256")
        self.tab = torch.tensor(rows, dtype=torch.int64, device=device)
        self.w_offs = offs
        self.half = half
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def weight(self, i: int) -> torch.Tensor:
        n, k = self.shapes[i]
        return self.w[self.w_offs[i]:self.w_offs[i] + n * k].view(n, k)

    def set_input(self, x: torch.Tensor) -> None:
        """``x [rows, K0]``: rows past ``rows`` stay zero."""
        self.act.zero_()
        k0 = self.shapes[0][1]
        self.act[:ROWS_PAD * k0].view(ROWS_PAD, k0)[:x.shape[0]] = x

    def output(self) -> torch.Tensor:
        n = self.shapes[-1][0]
        base = (len(self.shapes) % 2) * self.half
        return self.act[base:base + ROWS_PAD * n].view(ROWS_PAD, n)

    def run(self, programs: int, block_n: int, block_k: int, prefetch: bool, barrier: bool,
            num_warps: int = 4, num_stages: int = 3, flat: bool = False,
            gemv_rows: int = 0) -> None:
        self.counter.zero_()
        _chain_kernel[(programs,)](self.w, self.act, self.tab, self.counter, self.err,
                                   len(self.shapes), BLOCK_N=block_n, BLOCK_K=block_k,
                                   PREFETCH=prefetch, BARRIER=barrier, SPIN=SPIN_MAX, FLAT=flat,
                                   GEMV_ROWS=gemv_rows,
                                   num_warps=num_warps, num_stages=num_stages)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The chain in torch: each matmul in float32 from the 16-bit input, rounded to it,
        the next input the first ``ROWS_PAD * K`` values of the flattened output."""
        a = torch.zeros(ROWS_PAD, self.shapes[0][1], dtype=self.w.dtype, device=x.device)
        a[:x.shape[0]] = x
        for i, (n, k) in enumerate(self.shapes):
            a = a.reshape(-1)[:ROWS_PAD * k].view(ROWS_PAD, k)
            a = (a.float() @ self.weight(i).float().T).to(self.w.dtype)
        return a


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def smoke() -> None:
    # float16: the CPU interpreter's bf16 dot is wrong (triton 3.9)
    chain = Chain([(256, 256), (512, 256), (256, 512)], "cpu", dtype=torch.float16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    want = chain.reference(x)
    for flat in (False, True):
        for prefetch in (False, True):
            for block_k in (64, 256):  # 256: one K step a tile for K = 256
                chain.set_input(x)
                chain.run(1, 64, block_k, prefetch, True, flat=flat)
                assert chain.counter.item() == len(chain.shapes) and not chain.err.item()
                err = _rel_err(chain.output(), want)
                assert err < 2e-2, f"flat={flat} prefetch={prefetch}: relative error {err}"
                print(f"smoke flat={flat} prefetch={prefetch} block_k={block_k}: relative "
                      f"error {err:.2e}")
    for block_k in (64, 256):
        chain.set_input(x)
        chain.run(1, 16, block_k, False, True, gemv_rows=3)
        err = _rel_err(chain.output()[:3], want[:3])
        assert err < 2e-2, f"gemv block_k={block_k}: relative error {err}"
        print(f"smoke gemv block_k={block_k}: relative error {err:.2e}")


class ChainRun:
    """One GPU run over the chain (``opts.shapes``' (N, K) if given, else
    ``phases(opts.layers)``): its weights (``chain_cls``), a random input of ``opts.rows`` rows
    and the torch chain's output for it, and the report (``name``.json under ``$OUT`` or
    ``benchmarks/results/``, rewritten at each row)."""

    def __init__(self, opts, name: str, chain_cls=Chain) -> None:
        sys.path.insert(0, str(Path(__file__).parent))
        from common import time_calls

        self.dev = "cuda"
        self.rows = opts.rows
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.chain = chain_cls(getattr(opts, "shapes", None) or phases(opts.layers), self.dev)
        self.x = torch.randn(opts.rows, self.chain.shapes[0][1],
                             device=self.dev).to(torch.bfloat16)
        self.want = self.chain.reference(self.x)
        self.nbytes = self.chain.w.numel() * 2
        self.report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, command=" ".join(sys.argv),
                           rows=opts.rows, layers=opts.layers, weight_bytes=self.nbytes,
                           sms=self.sms, timing=TIMING, results=[])
        out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"{name}.json"
        self._time_calls = time_calls

    def timed(self, fn) -> float:
        """ms a call, CUDA-graph replays (``common.time_calls``)."""
        return self._time_calls([fn], TIMING, self.dev)["graph_us"] / 1e3

    def emit(self, row: dict) -> None:
        row["tb_per_s"] = self.nbytes / (row["ms"] * 1e-3) / 1e12
        self.report["results"].append(row)
        print(json.dumps(row), flush=True)
        self.path.write_text(json.dumps(self.report, indent=1))

    def read(self, per_sm: int, warps: int) -> None:
        """A ``read`` row: ``hbm_read.py``'s streaming kernel over the chain's weight bytes."""
        from hbm_read import _read_kernel

        sink = torch.empty(self.sms * per_sm, device=self.dev, dtype=torch.float32)
        w = self.chain.w
        self.emit(dict(kind="read", programs=self.sms * per_sm, warps=warps, ms=self.timed(
            lambda: _read_kernel[(self.sms * per_sm,)](w, sink, w.numel(), BLOCK=16384,
                                                       num_warps=warps))))

    def skinny_chain(self, **overrides) -> torch.Tensor:
        """The chain as one ``skinny_linear_triton`` launch a matmul (today's lowering)."""
        from dspark_compile.kernels.skinny import skinny_linear_triton

        a = self.x
        for i, (n, k) in enumerate(self.chain.shapes):
            a = a.reshape(-1)[:self.rows * k].view(self.rows, k)
            a = skinny_linear_triton(a, self.chain.weight(i), weight_settled=True,
                                     **overrides)[0]
        return a

    def skinny(self, overrides: dict) -> None:
        """A ``skinny`` row: the launch chain under tile ``overrides`` (``{}``: the plan's)."""
        try:
            err = _rel_err(self.skinny_chain(**overrides), self.want[:self.rows])
        except triton.runtime.errors.OutOfResources as e:  # a tile the sweep asks for
            self.emit(dict(kind="skinny", overrides=overrides, error=str(e), ms=float("inf")))
            return
        self.emit(dict(kind="skinny", overrides=overrides, rel_err=err,
                       ms=self.timed(lambda: self.skinny_chain(**overrides))))


def chain_args(doc: str) -> argparse.ArgumentParser:
    """The chain scripts' common options: ``--rows``, ``--layers``, ``--smoke``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    return ap


def main() -> None:
    ap = chain_args(__doc__)
    ap.add_argument("--skinny-sweep", action="store_true",
                    help="only the launch chain, under each of SKINNY_SWEEP's tile overrides")
    opts = ap.parse_args()
    if opts.smoke:
        smoke()
        return
    run = ChainRun(opts, "persistent_spike", Chain)
    chain, x, want, sms, emit, timed = run.chain, run.x, run.want, run.sms, run.emit, run.timed
    props = torch.cuda.get_device_properties(0)

    def resident(block_n, block_k, warps, stages, flat, rows) -> int:
        """Programs of this build a multiprocessor holds at once (registers, shared memory,
        warps), from the compiled kernel's metadata (compiled without a launch)."""
        ck = _chain_kernel.warmup(chain.w, chain.act, chain.tab, chain.counter, chain.err,
                                  len(chain.shapes), BLOCK_N=block_n, BLOCK_K=block_k,
                                  PREFETCH=False, BARRIER=True, SPIN=SPIN_MAX, FLAT=flat,
                                  GEMV_ROWS=rows, num_warps=warps, num_stages=stages,
                                  grid=(1,))
        ck._init_handles()  # loads the binary: registers are known from here
        regs = ck.n_regs * 32 * warps
        smem = max(ck.metadata.shared, 1)
        return min(getattr(props, "regs_per_multiprocessor", 65536) // regs,
                   getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // smem,
                   64 // warps)

    for per_sm, warps in ((2, 8), (4, 16)):
        run.read(per_sm, warps)
    for overrides in [{}] + (SKINNY_SWEEP if opts.skinny_sweep else []):
        run.skinny(overrides)
    if opts.skinny_sweep:
        return
    gemv = min(opts.rows, 4)
    for per_sm, block_n, block_k, warps, stages, flat, rows in (
            (1, 32, 256, 4, 4, False, 0), (1, 32, 256, 4, 4, True, 0),
            (1, 16, 1024, 8, 1, False, gemv), (2, 16, 512, 8, 2, False, gemv),
            (4, 8, 1024, 4, 1, False, gemv), (4, 16, 512, 4, 2, False, gemv),
            (1, 16, 1024, 8, 3, False, gemv), (2, 8, 512, 8, 1, False, gemv),
            (3, 16, 256, 4, 2, False, gemv)):
        programs = per_sm * sms
        fits = resident(block_n, block_k, warps, stages, flat, rows)
        if fits < per_sm:  # the barrier needs every program resident at once
            emit(dict(kind="skipped", per_sm=per_sm, resident=fits, block_n=block_n,
                      block_k=block_k, warps=warps, stages=stages, gemv_rows=rows, ms=float("inf")))
            continue
        modes = ((False, True), (True, True), (False, False)) if not rows else \
            ((False, True), (False, False))
        for prefetch, barrier in modes:
            fn = lambda: chain.run(programs, block_n, block_k, prefetch, barrier, warps,  # noqa: E731
                                   stages, flat, rows)
            chain.set_input(x)
            chain.err.zero_()
            fn()
            torch.cuda.synchronize()
            if row_timeout := bool(chain.err.item()):
                emit(dict(kind="timeout", programs=programs, block_n=block_n, ms=float("inf")))
                continue
            row = dict(kind="persistent" if barrier else "free", programs=programs,
                       block_n=block_n, block_k=block_k, warps=warps, stages=stages, flat=flat,
                       gemv_rows=rows,
                       prefetch=prefetch, spin_timeout=row_timeout, resident_per_sm=fits)
            if barrier:
                row["rel_err"] = _rel_err(chain.output()[:opts.rows], want[:opts.rows])
            chain.set_input(x)
            row["ms"] = timed(fn)
            emit(row)


if __name__ == "__main__":
    main()
