"""Probe: where the skinny matmul's weight stream at 3 rows loses against a plain read. The
weight layout (row-major, or packed so a program's bytes are contiguous), the activation
loads, the pipeline depth, or how the work falls on the programs and launches?

Layouts of the stream kernel (``pack``): 0, the row-major ``[N, K]`` weight (a ``[BLOCK_N,
BLOCK_K]`` tile is ``BLOCK_N`` runs of ``2 * BLOCK_K`` bytes, ``K`` apart); 1, ``[N / BLOCK_N, K /
BLOCK_K, BLOCK_N, BLOCK_K]`` (a column tile's whole K stream one run); 2, ``[K / BLOCK_K, N /
BLOCK_N, BLOCK_N, BLOCK_K]`` (programs in step read neighbouring tiles, as a plain read's do).

Measured, one process, CUDA-graph replays over a chain of matmuls (by default the 1.1B model's of
``persistent_spike.py``: 16 layers of q+k+v, o, gate+up, down, then the LM head, 2.14 GB of
bf16 weights; ``--shapes`` gives others), ms a chain:
- ``read``: ``hbm_read.py``'s streaming kernel over the same bytes (the ceiling);
- ``skinny``: ``skinny_linear_triton`` a matmul (today's lowering), with the plan's tiles and
  with the overrides of ``SKINNY_TILES`` (or ``--skinny``);
- ``stream``: this file's kernel, persistent programs taking column tiles of every matmul in
  turn with the dependency between matmuls dropped (the stream rate alone), in each layout,
  over ``CONFIGS`` (or ``--configs``: row-major only);
- ``stream_rotated`` (``--rotate``): the row-major stream with the tiles dealt on across
  matmuls (``ROTATE``), so that each program gets about the chain's tiles over the programs;
- ``stream_no_x``: the same kernel with ones for the activation tile (no loads but the weights'):
  how much the activation loads every program makes from L2 cost;
- ``stream_clocks`` (``--clocks``): one launch of each row-major stream (and, with ``--rotate``,
  rotated) with every program's start and end on the GPU's timer: how unequal the programs'
  run times are (``program_summary``).
Each stream form is also run once as a valid chain with one program against the torch chain
(``--smoke`` does that on the CPU, under the interpreter, in float16). A chain's shapes must
let each matmul read its input from the last one's output (K <= the previous N).

    python benchmarks/packed_weights.py [--rows 3] [--quick] [--configs N,K,W,S,P ...]
        [--shapes NxK[*R] ...] [--skinny KEY=V,... ...] [--rotate] [--clocks] [--smoke]

Writes ``packed_weights.json`` to ``$OUT`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read when @triton.jit decorates
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from persistent_spike import (BLOCK_M, Chain, ChainRun, _phase, _rel_err,  # noqa: E402
                              chain_args)

CONFIGS = (  # (BLOCK_N, BLOCK_K, warps, stages, programs a multiprocessor)
    (64, 128, 4, 5, 1), (64, 128, 4, 4, 2), (32, 256, 4, 4, 1), (32, 256, 4, 3, 2),
    (16, 512, 4, 3, 1), (16, 512, 4, 3, 2), (128, 128, 8, 4, 1), (64, 256, 4, 3, 1))
SKINNY_TILES = ({}, dict(block_n=16, block_k=512, num_stages=3),
                dict(block_n=32, block_k=256, num_stages=4),
                dict(block_n=32, block_k=512, num_stages=3),
                dict(block_n=16, block_k=1024, num_stages=2))
"""``skinny_linear_triton`` tile overrides for every matmul of the chain (``{}``: the plan's)."""


@triton.jit
def _stream_kernel(w_ptr, act_ptr, tab_ptr, cols_ptr, owner_ptr, clock_ptr, num_phases,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PACKED: tl.constexpr,
                   X_LOAD: tl.constexpr = True, ROTATE: tl.constexpr = False,
                   RECORD: tl.constexpr = False, CLOCKS: tl.constexpr = False):
    """Every phase of the table in turn, no barrier; program ``pid`` takes column tiles ``pid,
    pid + programs, ...`` of ``act_out[BLOCK_M, n] = act_in[BLOCK_M, k] @ w[n, k].T``. With
    ``ROTATE`` the tiles are dealt on from where the last phase's stopped (the chain's tiles
    numbered in order, program ``pid`` takes those equal to it modulo the programs), so a
    matmul of fewer tiles than programs does not fall on the same programs every time
    (``cols_ptr[p]``: the columns of the phases before ``p``; read, not carried through the
    phase loop: triton 3.5-3.7 drop a carried value that only sets an inner loop's bounds,
    ``tests/aot.py``'s ``bound_only_carries``). With
    ``PACKED`` the phase's weight is ``[n / BLOCK_N, k / BLOCK_K, BLOCK_N, BLOCK_K]``. Without
    ``X_LOAD`` the activation tile is ones made in registers, not loaded (not a valid product:
    the weight stream alone, without the activations every program reads from L2). With
    ``RECORD`` each program writes its id at ``owner_ptr[tile]`` (the chain's tiles numbered in
    order), so the dealing compiled for the device can be checked against the rule. With
    ``CLOCKS`` (CUDA only, not the interpreter) each program writes ``clock_ptr[3 * pid ...]``:
    its start and end on the GPU's global timer (ns) and the multiprocessor it ran on."""
    pid = tl.program_id(0)
    if CLOCKS:
        t0 = tl.extra.cuda.globaltimer()
    nprog = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    for p in range(num_phases):
        w_off, n, k, in_off, out_off = _phase(tab_ptr, p)
        base = tl.load(cols_ptr + p).to(tl.int32) // BLOCK_N  # tiles of the phases before
        first = pid
        if ROTATE:
            first = (pid - base % nprog + nprog) % nprog
        for t in range(first, n // BLOCK_N, nprog):
            if RECORD:
                tl.store(owner_ptr + base + t, pid)
            if PACKED == 2:  # K-step-major: a K step's tiles of every column tile side by side
                w_ptrs = (w_ptr + w_off + t * BLOCK_N * BLOCK_K
                          + offs_n[:, None] * BLOCK_K + offs_k[None, :])
                w_step = n * BLOCK_K
            elif PACKED == 1:
                w_ptrs = (w_ptr + w_off + t * BLOCK_N * k  # < 2^31: the LM head is 65M
                          + offs_n[:, None] * BLOCK_K + offs_k[None, :])
                w_step = BLOCK_N * BLOCK_K
            else:
                w_ptrs = (w_ptr + w_off + (t * BLOCK_N + offs_n)[:, None].to(tl.int64) * k
                          + offs_k[None, :])
                w_step = BLOCK_K
            x_ptrs = act_ptr + in_off + offs_m[None, :] * k + offs_k[:, None]
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for _ in range(0, k, BLOCK_K):
                if X_LOAD:
                    xt = tl.load(x_ptrs, cache_modifier=".cg")
                else:
                    xt = tl.full([BLOCK_K, BLOCK_M], 1.0, act_ptr.dtype.element_ty)
                acc = tl.dot(tl.load(w_ptrs), xt, acc)
                w_ptrs += w_step
                x_ptrs += BLOCK_K
            out = act_ptr + out_off + offs_m[None, :] * n + (t * BLOCK_N + offs_n)[:, None]
            tl.store(out, acc.to(act_ptr.dtype.element_ty))
    if CLOCKS:
        tl.store(clock_ptr + 3 * pid, t0)
        tl.store(clock_ptr + 3 * pid + 1, tl.extra.cuda.globaltimer())
        tl.store(clock_ptr + 3 * pid + 2, tl.extra.cuda.smid().to(tl.int64))


def program_summary(clocks: torch.Tensor) -> dict:
    """``clocks [programs, 3]`` (start ns, end ns, multiprocessor) -> the launch's span (``ms``,
    as every row has, and ``span_us``), per-program run times (us): fewest, median, most, the
    busy share of the span, and the five slowest as ``(program, multiprocessor, us)``."""
    start, end, sm = clocks[:, 0], clocks[:, 1], clocks[:, 2]
    us = (end - start).double() / 1e3
    span = float(end.max() - start.min()) / 1e3
    slow = us.argsort(descending=True)[:5].tolist()
    return {"ms": span / 1e3, "span_us": span, "min_us": float(us.min()),
            "median_us": float(us.median()),
            "max_us": float(us.max()), "busy_share": float(us.sum()) / (span * len(us)),
            "slowest": [(p, int(sm[p]), round(float(us[p]), 1)) for p in slow]}


def pack(w: torch.Tensor, block_n: int, block_k: int, layout: int = 1) -> torch.Tensor:
    """``[N, K]`` -> ``[N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]`` (``layout`` 1: a column
    tile's K stream contiguous) or ``[K / BLOCK_K, N / BLOCK_N, BLOCK_N, BLOCK_K]`` (2: a K
    step's tiles contiguous, so programs in step read neighbouring bytes, as a plain read's
    programs do), flat."""
    n, k = w.shape
    tiles = w.view(n // block_n, block_n, k // block_k, block_k)
    order = (0, 2, 1, 3) if layout == 1 else (2, 0, 1, 3)
    return tiles.permute(*order).reshape(-1)


class PackedChain(Chain):
    """``Chain`` with a second weight buffer, every phase packed for ``(block_n, block_k)``, and
    each phase's first column in the chain (``cols``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        widths = torch.tensor([0] + [n for n, _ in self.shapes[:-1]], dtype=torch.int64)
        self.cols = widths.cumsum(0).to(self.act.device)

    def packed(self, block_n: int, block_k: int, layout: int = 1) -> torch.Tensor:
        out = torch.empty_like(self.w)
        for i, off in enumerate(self.w_offs):
            w = self.weight(i)
            out[off:off + w.numel()] = pack(w, block_n, block_k, layout)
        return out

    def stream(self, w: torch.Tensor, programs: int, block_n: int, block_k: int, packed: int,
               num_warps: int = 4, num_stages: int = 3, x_load: bool = True,
               rotate: bool = False, owner: torch.Tensor | None = None,
               clocks: torch.Tensor | None = None) -> None:
        """One stream launch; ``owner`` (int32, a slot per tile of the chain) records which
        program took each tile, ``clocks`` (int64 ``[programs, 3]``) each program's start,
        end (ns) and multiprocessor."""
        _stream_kernel[(programs,)](w, self.act, self.tab, self.cols,
                                    self.counter if owner is None else owner,
                                    self.err if clocks is None else clocks,
                                    len(self.shapes), BLOCK_N=block_n, BLOCK_K=block_k,
                                    PACKED=packed, X_LOAD=x_load, ROTATE=rotate,
                                    RECORD=owner is not None, CLOCKS=clocks is not None,
                                    num_warps=num_warps, num_stages=num_stages)

    def program_times(self, w: torch.Tensor, programs: int, block_n: int, block_k: int,
                      rotate: bool, **launch) -> dict:
        """One stream launch with every program's clocks: how long each ran (us), the share of
        the launch's span they were busy (the multiprocessors' active share when one program
        runs on each), and the slowest programs with their multiprocessors."""
        clocks = torch.zeros(programs, 3, dtype=torch.int64, device=self.act.device)
        self.stream(w, programs, block_n, block_k, 0, rotate=rotate, clocks=clocks, **launch)
        return program_summary(clocks.cpu())

    def dealing(self, programs: int, block_n: int, rotate: bool) -> torch.Tensor:
        """The program each tile of the chain goes to under the stream's rule (tiles numbered
        in order): ``t + dealt`` modulo the programs with ``ROTATE``, ``t`` without."""
        owners, dealt = [], 0
        for n, _ in self.shapes:
            tiles = torch.arange(n // block_n)
            owners.append((tiles + (dealt if rotate else 0)) % programs)
            dealt = (dealt + n // block_n) % programs
        return torch.cat(owners).to(torch.int32)

    def check_dealing(self, w: torch.Tensor, programs: int, block_n: int, block_k: int,
                      rotate: bool, **launch) -> tuple[int, int]:
        """Run the stream once recording owners; raise unless every tile went where the rule
        says. Returns the fewest and most tiles a program took."""
        want = self.dealing(programs, block_n, rotate)
        owner = torch.full_like(want, -1, device=self.act.device)
        self.stream(w, programs, block_n, block_k, 0, rotate=rotate, owner=owner, **launch)
        got = owner.cpu()
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0, 0])
            raise RuntimeError(f"stream dealing (rotate={rotate}): tile {bad} went to program "
                               f"{int(got[bad])}, the rule gives {int(want[bad])}")
        counts = torch.bincount(want.long(), minlength=programs)
        return int(counts.min()), int(counts.max())


def smoke() -> None:
    # float16: the CPU interpreter's bf16 dot is wrong (triton 3.9)
    chain = PackedChain([(256, 256), (512, 256), (256, 512)], "cpu", dtype=torch.float16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    want = chain.reference(x)
    for block_n, block_k in ((64, 64), (16, 256)):
        for packed in (0, 1, 2):
            chain.set_input(x)
            w = chain.packed(block_n, block_k, packed) if packed else chain.w
            chain.stream(w, 1, block_n, block_k, packed)
            err = _rel_err(chain.output(), want)
            assert err < 2e-2, f"packed={packed} {block_n}x{block_k}: relative error {err}"
            print(f"smoke packed={packed} {block_n}x{block_k}: relative error {err:.2e}")
    # ROTATE deals every tile of every phase to exactly one of 3 programs. The interpreter runs
    # them one after another, so a later phase may read an input not yet written: without the
    # activation loads every tile's output is its weight rows' sums whatever the order, and a
    # tile no program took keeps the NaN it starts with.
    dealt = PackedChain([(256, 256), (512, 256), (256, 512), (512, 256)], "cpu",
                        dtype=torch.float16)
    dealt.act.fill_(float("nan"))
    dealt.stream(dealt.w, 3, 64, 64, 0, x_load=False, rotate=True)
    half = dealt.half
    for i in (2, 3):  # the last phase to write each half of the ping-pong buffer
        n = dealt.shapes[i][0]
        got = dealt.act[((i + 1) % 2) * half:][:n].float()
        want = dealt.weight(i).float().sum(1)
        assert _rel_err(got, want) < 2e-2, f"rotate: phase {i} missed tiles or summed wrong"
    for rotate in (False, True):  # each tile's program, recorded, is the rule's
        dealt.check_dealing(dealt.w, 3, 64, 64, rotate, x_load=False)
    print("smoke rotate: every tile dealt once")
    one = PackedChain([(256, 256)], "cpu", dtype=torch.float16)  # no activation loads: ones
    one.stream(one.packed(64, 64), 1, 64, 64, True, x_load=False)
    err = _rel_err(one.output()[0], one.weight(0).float().sum(1))
    assert err < 2e-2, f"x_load=False: relative error {err}"


def shape_arg(text: str) -> list[tuple[int, int]]:
    """``--shapes``' ``NxK`` or ``NxK*R``: R copies of (N, K)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:\*(\d+))?", text)
    if m is None or not int(m[1]) or not int(m[2]) or m[3] is not None and not int(m[3]):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is NxK or NxK*R, positive integers "
                                         "(e.g. 2048x2048*128)")
    return [(int(m[1]), int(m[2]))] * int(m[3] or 1)


def main() -> None:
    ap = chain_args(__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="the plan's skinny tiles and the first three stream configurations only")
    ap.add_argument("--configs", nargs="+", metavar="N,K,WARPS,STAGES,PER_SM",
                    help="stream configurations instead of CONFIGS (BLOCK_N, BLOCK_K, warps, "
                         "stages, programs a multiprocessor), row-major only")
    ap.add_argument("--skinny", nargs="+", metavar="KEY=V,...", default=None,
                    help="skinny_linear_triton overrides instead of SKINNY_TILES "
                         "(e.g. block_n=16,split_k=1); with it, no stream rows")
    ap.add_argument("--rotate", action="store_true",
                    help="also time each row-major configuration with ROTATE (stream_rotated)")
    ap.add_argument("--clocks", action="store_true",
                    help="also record each program's start and end in one launch of each "
                         "row-major stream (and rotated one): stream_clocks rows")
    ap.add_argument("--shapes", nargs="+", metavar="NxK[*R]", type=shape_arg,
                    help="the chain's matmuls instead of the model's (R repeats of N x K)")
    opts = ap.parse_args()
    if opts.shapes:
        opts.shapes = [shape for shapes in opts.shapes for shape in shapes]
    if opts.smoke:
        smoke()
        return
    run = ChainRun(opts, "packed_weights", PackedChain)
    chain, x, want, sms = run.chain, run.x, run.want, run.sms
    run.read(2, 8)
    if opts.skinny is not None:
        for o in [{}] + [dict((kv.split("=")[0], int(kv.split("=")[1])) for kv in arg.split(","))
                         for arg in opts.skinny]:
            run.skinny(o)
        return
    for overrides in SKINNY_TILES[:1] if opts.quick or opts.configs else SKINNY_TILES:
        run.skinny(overrides)
    configs = [tuple(int(v) for v in c.split(",")) for c in opts.configs or ()]
    for block_n, block_k, warps, stages, per_sm in configs or (
            CONFIGS[:3] if opts.quick else CONFIGS):
        for packed in (0,) if configs else (0, 1, 2):
            w = chain.packed(block_n, block_k, packed) if packed else chain.w
            chain.set_input(x)  # one program: the phases run in order, a valid chain
            chain.stream(w, 1, block_n, block_k, packed, warps, stages)
            err = _rel_err(chain.output()[:opts.rows], want[:opts.rows])
            chain.set_input(x)
            run.emit(dict(kind="stream", packed=packed, block_n=block_n, block_k=block_k,
                          warps=warps, stages=stages, programs=per_sm * sms, rel_err=err,
                          ms=run.timed(lambda w=w, p=packed: chain.stream(
                              w, per_sm * sms, block_n, block_k, p, warps, stages))))
            if opts.rotate and not packed:
                fewest, most = chain.check_dealing(w, per_sm * sms, block_n, block_k, True,
                                                   num_warps=warps, num_stages=stages)
                run.emit(dict(kind="stream_rotated", packed=packed, block_n=block_n,
                              block_k=block_k, warps=warps, stages=stages,
                              programs=per_sm * sms, tiles_per_program=[fewest, most],
                              ms=run.timed(
                                  lambda w=w: chain.stream(w, per_sm * sms, block_n, block_k, 0,
                                                           warps, stages, rotate=True))))
            for rotate in ((False, True) if opts.rotate else (False,)) \
                    if opts.clocks and not packed else ():
                run.emit(dict(kind="stream_clocks", rotate=rotate, block_n=block_n,
                              block_k=block_k, warps=warps, stages=stages,
                              programs=per_sm * sms, **chain.program_times(
                                  w, per_sm * sms, block_n, block_k, rotate,
                                  num_warps=warps, num_stages=stages)))
            if (block_n, block_k, warps, stages, per_sm) in CONFIGS[:3]:
                run.emit(dict(kind="stream_no_x", packed=packed, block_n=block_n,
                              block_k=block_k, warps=warps, stages=stages,
                              programs=per_sm * sms, ms=run.timed(
                                  lambda w=w, p=packed: chain.stream(
                                      w, per_sm * sms, block_n, block_k, p, warps, stages,
                                      x_load=False))))
            del w


if __name__ == "__main__":
    main()
