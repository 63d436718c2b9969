"""Spike: the bs-1 matmul chain as one persistent launch that keeps the dependency between
matmuls but no grid barrier. Does it keep the evenly dealt free stream's rate?

``packed_weights.py --rotate`` streams the 1.1B model's 65 matmuls at 4.06-4.18 TB/s when every
program gets the chain's tiles over the programs and nothing waits (3.07 for today's 65 skinny
launches). A valid chain must wait: each matmul reads the whole output of the one before. Here
the work is units of (phase, column tile, K split), a small matmul split in K until its units
reach the programs, numbered in phase order; program ``pid`` takes units ``pid, pid + programs,
...``, so it runs ahead into later phases as far as the dependency allows. A unit of phase ``p``
waits only for phase ``p - 1`` to be complete (a counter of its finished column tiles, acquire),
not for every program. A tile's K splits leave fp32 partials; the split that finishes last (a
counter per tile) sums them in split order, stores the tile and counts it done (release).

With ``L2``, before it waits a unit asks L2 for its own weight rows (one bulk prefetch a row,
``cp.async.bulk.prefetch.L2``, CUDA only), so the weight read overlaps the wait and the unit's
loads after it hit L2.

Measured here, one process, graph replays (ms a chain; the counters' zeroing is in the graph):
- ``read`` and ``skinny`` as in ``persistent_spike.py`` (a plain read; today's launches);
- ``flow``: this kernel, without and with ``L2``;
- ``flow_free``: the same units with the waits dropped (not a valid chain: the rate when
  nothing waits).
Each valid form is checked against the torch chain of ``persistent_spike.py``.

    python benchmarks/flow_chain.py [--rows 3] [--layers 16] [--configs N,K,WARPS,STAGES ...]
        [--smoke]

``--smoke`` runs small phases on the CPU under ``TRITON_INTERPRET=1`` with one program (every
wait passes at once: the program takes the phases in order). Writes ``flow_chain.json`` to
``$OUT`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read when @triton.jit decorates
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from persistent_spike import (BLOCK_M, SPIN_MAX, Chain, ChainRun, _phase, _rel_err,  # noqa: E402
                              _wait, chain_args)

CONFIGS = ((64, 128, 4, 4), (64, 128, 4, 5), (32, 256, 4, 4))
"""(BLOCK_N, BLOCK_K, warps, stages) of the flow kernel."""
UNIT_COLS = tl.constexpr(6)
"""Columns of a unit's row in the unit table: phase, tile, split, splits, the tile's counter,
the column tiles of the phase before."""


@triton.jit
def _l2_rows(w_ptr, rows, k, k0, k_len):
    """Ask L2 for ``w[rows, k0:k0 + k_len]`` (16-bit, rows ``k`` apart), one bulk prefetch a row
    (``k0`` and ``k_len`` multiples of 8)."""
    ptrs = (w_ptr + rows.to(tl.int64) * k + k0).to(tl.pointer_type(tl.int8))
    size = tl.zeros_like(rows) + k_len * 2
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0 unused",
                              "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _flow_kernel(w_ptr, act_ptr, tab_ptr, unit_ptr, ready_ptr, part_ptr, count_ptr, err_ptr,
                 num_units, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEP: tl.constexpr,
                 L2: tl.constexpr, SPIN: tl.constexpr, ROWS: tl.constexpr):
    """Units ``pid, pid + programs, ...`` of the table (module docstring). Phase ``p``'s unit
    ``(tile t, split s of S)``: ``act_out[:, t] (+)= act_in[:, ks] @ w[t, ks].T`` over the
    split's K; ``ready_ptr[p]`` counts phase ``p``'s finished column tiles. Partials hold the
    first ``ROWS`` rows (the rest of the activation tile is zeros)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    for g in range(pid, num_units, nprog):
        g64 = g + tl.zeros((), tl.int64)  # (the interpreter's g is a Python int)
        row = unit_ptr + g64 * UNIT_COLS
        phase = tl.load(row)
        tile = tl.load(row + 1)
        split = tl.load(row + 2)
        splits = tl.load(row + 3)
        counter = tl.load(row + 4)
        need = tl.load(row + 5)
        w_off, n, k, in_off, out_off = _phase(tab_ptr, phase)
        k_len = tl.multiple_of(k // splits, 128)
        k0 = tl.multiple_of(split * k_len, 128)
        cols = tile * BLOCK_N + offs_n
        if L2:
            _l2_rows(w_ptr + w_off, cols, k, k0, k_len)
        if DEP:
            if phase > 0:
                _wait(ready_ptr + phase - 1, need, err_ptr, SPIN)
        w_ptrs = w_ptr + w_off + cols[:, None].to(tl.int64) * k + (k0 + offs_k)[None, :]
        x_ptrs = act_ptr + in_off + offs_m[None, :] * k + (k0 + offs_k)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            x = tl.load(x_ptrs, cache_modifier=".cg")  # another program wrote it: not from L1
            acc = tl.dot(tl.load(w_ptrs), x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = act_ptr + out_off + offs_m[None, :] * n + cols[:, None]
        tile_part = offs_n[:, None] * BLOCK_M + offs_m[None, :]
        live = (offs_m < ROWS)[None, :]
        done = splits == 1
        if splits > 1:
            tl.store(part_ptr + g64 * (BLOCK_N * BLOCK_M) + tile_part, acc, mask=live)
            tl.debug_barrier()  # every thread's partial issued before the count
            done = tl.atomic_add(count_ptr + counter, 1, sem="acq_rel") == splits - 1
            if done:  # the last split: the partials in split order
                first = g64 - split
                acc = tl.load(part_ptr + first * (BLOCK_N * BLOCK_M) + tile_part, mask=live,
                              other=0.0, cache_modifier=".cg")
                for s in range(1, splits):
                    acc += tl.load(part_ptr + (first + s) * (BLOCK_N * BLOCK_M) + tile_part,
                                   mask=live, other=0.0, cache_modifier=".cg")
        if done:
            tl.store(out, acc.to(act_ptr.dtype.element_ty))
            tl.debug_barrier()  # every thread's store issued before the count
            tl.atomic_add(ready_ptr + phase, 1, sem="release")


def unit_table(shapes: list[tuple[int, int]], programs: int, block_n: int,
               block_k: int) -> torch.Tensor:
    """``[units, UNIT_COLS]`` int32: every phase's column tiles, each split in K (a power of two)
    until the phase has at least ``programs`` units, keeping whole ``BLOCK_K`` steps a split;
    a tile's splits consecutive, phases in order."""
    rows, tile_id, prev_tiles = [], 0, 0
    for p, (n, k) in enumerate(shapes):
        if n % block_n or k % block_k:
            raise ValueError(f"phase {p}: N x K = {n} x {k} is not whole {block_n} x {block_k} "
                             "tiles")
        tiles, splits = n // block_n, 1
        while tiles * splits < programs and k % (2 * splits * block_k) == 0 \
                and (k // (2 * splits)) % 128 == 0:
            splits *= 2
        for t in range(tiles):
            rows += [(p, t, s, splits, tile_id + t, prev_tiles) for s in range(splits)]
        tile_id += tiles
        prev_tiles = tiles
    return torch.tensor(rows, dtype=torch.int32).view(-1, UNIT_COLS.value)


class FlowChain(Chain):
    """``Chain`` with the flow kernel's unit table, counters and partials."""

    def plan(self, programs: int, block_n: int, block_k: int) -> None:
        self.units = unit_table(self.shapes, programs, block_n, block_k).to(self.act.device)
        tiles = int(self.units[:, 4].max()) + 1
        self.ready = torch.zeros(len(self.shapes), dtype=torch.int32, device=self.act.device)
        self.count = torch.zeros(tiles, dtype=torch.int32, device=self.act.device)
        self.part = torch.empty(self.units.shape[0] * block_n * int(BLOCK_M),
                                dtype=torch.float32, device=self.act.device)

    def flow(self, programs: int, block_n: int, block_k: int, dep: bool = True,
             l2: bool = False, num_warps: int = 4, num_stages: int = 4, rows: int = 3) -> None:
        self.ready.zero_()
        self.count.zero_()
        _flow_kernel[(programs,)](self.w, self.act, self.tab, self.units, self.ready, self.part,
                                  self.count, self.err, self.units.shape[0], BLOCK_N=block_n,
                                  BLOCK_K=block_k, DEP=dep, L2=l2, SPIN=SPIN_MAX, ROWS=rows,
                                  num_warps=num_warps, num_stages=num_stages)


def smoke() -> None:
    # float16: the CPU interpreter's bf16 dot is wrong (triton 3.9)
    chain = FlowChain([(256, 256), (512, 256), (256, 512), (256, 256)], "cpu",
                      dtype=torch.float16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    want = chain.reference(x)
    for programs, block_n, block_k in ((1, 64, 128), (16, 64, 128)):
        # programs: the split rule's target; one program runs the units (the waits pass)
        chain.plan(programs, block_n, block_k)
        splits = chain.units[:, 3]
        chain.set_input(x)
        chain.flow(1, block_n, block_k)
        err = _rel_err(chain.output()[:3], want[:3])
        assert err < 2e-2, f"{programs} {block_n}x{block_k}: relative error {err}"
        assert chain.ready.tolist() == [n // block_n for n, _ in chain.shapes]
        assert not chain.err.item()
        print(f"smoke flow, splits up to {int(splits.max())} ({block_n}x{block_k}): relative "
              f"error {err:.2e}")


def measure(run: ChainRun, block_n: int, block_k: int, warps: int, stages: int) -> None:
    """The flow rows of one configuration: a valid chain without and with ``L2`` (checked
    against the torch chain), then without the waits."""
    chain, rows = run.chain, run.rows
    chain.plan(run.sms, block_n, block_k)
    base = dict(block_n=block_n, block_k=block_k, warps=warps, stages=stages, programs=run.sms,
                units=chain.units.shape[0], most_splits=int(chain.units[:, 3].max()))
    for dep, l2 in ((True, False), (True, True), (False, False)):
        def go(dep=dep, l2=l2):
            chain.flow(run.sms, block_n, block_k, dep, l2, warps, stages, rows)
        chain.set_input(run.x)
        chain.err.zero_()
        go()
        row = dict(kind="flow" if dep else "flow_free", l2=l2, **base)
        if dep:
            row["rel_err"] = _rel_err(chain.output()[:rows], run.want[:rows])
            row["spin_timeout"] = bool(chain.err.item())
        chain.set_input(run.x)
        row["ms"] = run.timed(go)
        run.emit(row)


def main() -> None:
    ap = chain_args(__doc__)
    ap.add_argument("--configs", nargs="+", metavar="N,K,WARPS,STAGES",
                    help="flow configurations instead of CONFIGS")
    opts = ap.parse_args()
    if opts.smoke:
        return smoke()
    run = ChainRun(opts, "flow_chain", FlowChain)
    run.read(2, 8)  # the ceiling, then today's launches, in the same run
    run.skinny({})
    for config in ([tuple(int(v) for v in c.split(",")) for c in opts.configs]
                   if opts.configs else CONFIGS):
        measure(run, *config)


if __name__ == "__main__":
    main()
