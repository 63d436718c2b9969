"""Probe: does the skinny matmul's weight stream at 3 rows run faster when each program's weight
bytes are one contiguous run (tile-packed weights) instead of ``BLOCK_K``-wide slices of
``BLOCK_N`` rows ``K`` apart (the row-major ``[N, K]`` weight)?

``persistent_spike.py`` found the bs-1 chain's tensor-core matmul streaming at 3.1 TB/s with
nothing to wait for, against 4.6 for a plain read of the same bytes. A row-major tile
``[BLOCK_N, BLOCK_K]`` reads ``BLOCK_N`` runs of ``2 * BLOCK_K`` bytes, each in another DRAM
row; the plain read takes long contiguous runs. Packed here: the ``[N, K]`` weight stored as
``[N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]``, so a column tile's whole K stream is one run
of ``2 * BLOCK_N * K`` bytes.

Measured, one process, CUDA-graph replays over the chain of ``persistent_spike.py`` (16 layers
of q+k+v, o, gate+up, down, then the LM head; 2.14 GB of bf16 weights), ms a chain:
- ``read``: ``hbm_read.py``'s streaming kernel over the same bytes (the ceiling);
- ``skinny``: ``skinny_linear_triton`` a matmul (today's lowering), with the plan's tiles and
  with longer row-major runs (``SKINNY_TILES``);
- ``stream``: this file's kernel, persistent programs taking column tiles of every matmul in
  turn with the dependency between matmuls dropped (the stream rate alone), row-major and
  packed, over a few tiles and programs a multiprocessor;
- ``stream_no_x``: the same kernel with ones for the activation tile (no loads but the weights'):
  how much the activation loads every program makes from L2 cost.
Each stream form is also run once as a valid chain with one program against the torch chain
(``--smoke`` does that on the CPU, under the interpreter, in float16).

    python benchmarks/packed_weights.py [--rows 3] [--smoke]

Writes ``packed_weights.json`` to ``$OUT`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # read when @triton.jit decorates
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from persistent_spike import BLOCK_M, Chain, ChainRun, _phase, _rel_err  # noqa: E402

CONFIGS = (  # (BLOCK_N, BLOCK_K, warps, stages, programs a multiprocessor)
    (64, 128, 4, 5, 1), (64, 128, 4, 4, 2), (32, 256, 4, 4, 1), (32, 256, 4, 3, 2),
    (16, 512, 4, 3, 1), (16, 512, 4, 3, 2), (128, 128, 8, 4, 1), (64, 256, 4, 3, 1))
SKINNY_TILES = ({}, dict(block_n=16, block_k=512, num_stages=3),
                dict(block_n=32, block_k=256, num_stages=4),
                dict(block_n=32, block_k=512, num_stages=3),
                dict(block_n=16, block_k=1024, num_stages=2))
"""``skinny_linear_triton`` tile overrides for every matmul of the chain (``{}``: the plan's)."""


@triton.jit
def _stream_kernel(w_ptr, act_ptr, tab_ptr, num_phases, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PACKED: tl.constexpr, X_LOAD: tl.constexpr = True):
    """Every phase of the table in turn, no barrier; program ``pid`` takes column tiles ``pid,
    pid + programs, ...`` of ``act_out[BLOCK_M, n] = act_in[BLOCK_M, k] @ w[n, k].T``. With
    ``PACKED`` the phase's weight is ``[n / BLOCK_N, k / BLOCK_K, BLOCK_N, BLOCK_K]``. Without
    ``X_LOAD`` the activation tile is ones made in registers, not loaded (not a valid product:
    the weight stream alone, without the activations every program reads from L2)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    for p in range(num_phases):
        w_off, n, k, in_off, out_off = _phase(tab_ptr, p)
        for t in range(pid, n // BLOCK_N, nprog):
            if PACKED:
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


def pack(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """``[N, K]`` -> ``[N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]``, flat."""
    n, k = w.shape
    return w.view(n // block_n, block_n, k // block_k, block_k).permute(0, 2, 1, 3).reshape(-1)


class PackedChain(Chain):
    """``Chain`` with a second weight buffer, every phase packed for ``(block_n, block_k)``."""

    def packed(self, block_n: int, block_k: int) -> torch.Tensor:
        out = torch.empty_like(self.w)
        for i, off in enumerate(self.w_offs):
            w = self.weight(i)
            out[off:off + w.numel()] = pack(w, block_n, block_k)
        return out

    def stream(self, w: torch.Tensor, programs: int, block_n: int, block_k: int, packed: bool,
               num_warps: int = 4, num_stages: int = 3, x_load: bool = True) -> None:
        _stream_kernel[(programs,)](w, self.act, self.tab, len(self.shapes), BLOCK_N=block_n,
                                    BLOCK_K=block_k, PACKED=packed, X_LOAD=x_load,
                                    num_warps=num_warps, num_stages=num_stages)


def smoke() -> None:
    # float16: the CPU interpreter's bf16 dot is wrong (triton 3.9)
    chain = PackedChain([(256, 256), (512, 256), (256, 512)], "cpu", dtype=torch.float16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    want = chain.reference(x)
    for block_n, block_k in ((64, 64), (16, 256)):
        for packed in (False, True):
            chain.set_input(x)
            w = chain.packed(block_n, block_k) if packed else chain.w
            chain.stream(w, 1, block_n, block_k, packed)
            err = _rel_err(chain.output(), want)
            assert err < 2e-2, f"packed={packed} {block_n}x{block_k}: relative error {err}"
            print(f"smoke packed={packed} {block_n}x{block_k}: relative error {err:.2e}")
    one = PackedChain([(256, 256)], "cpu", dtype=torch.float16)  # no activation loads: ones
    one.stream(one.packed(64, 64), 1, 64, 64, True, x_load=False)
    err = _rel_err(one.output()[0], one.weight(0).float().sum(1))
    assert err < 2e-2, f"x_load=False: relative error {err}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--smoke", action="store_true")
    opts = ap.parse_args()
    if opts.smoke:
        smoke()
        return
    run = ChainRun(opts, "packed_weights", PackedChain)
    chain, x, want, sms = run.chain, run.x, run.want, run.sms
    run.read(2, 8)
    for overrides in SKINNY_TILES:
        run.skinny(overrides)
    for block_n, block_k, warps, stages, per_sm in CONFIGS:
        wp = chain.packed(block_n, block_k)
        for packed in (False, True):
            w = wp if packed else chain.w
            chain.set_input(x)  # one program: the phases run in order, a valid chain
            chain.stream(w, 1, block_n, block_k, packed, warps, stages)
            err = _rel_err(chain.output()[:opts.rows], want[:opts.rows])
            chain.set_input(x)
            run.emit(dict(kind="stream", packed=packed, block_n=block_n, block_k=block_k,
                          warps=warps, stages=stages, programs=per_sm * sms, rel_err=err,
                          ms=run.timed(lambda w=w, p=packed: chain.stream(
                              w, per_sm * sms, block_n, block_k, p, warps, stages))))
            if (block_n, block_k, warps, stages, per_sm) in CONFIGS[:3]:
                run.emit(dict(kind="stream_no_x", packed=packed, block_n=block_n,
                              block_k=block_k, warps=warps, stages=stages,
                              programs=per_sm * sms, ms=run.timed(
                                  lambda w=w, p=packed: chain.stream(
                                      w, per_sm * sms, block_n, block_k, p, warps, stages,
                                      x_load=False))))
        del wp


if __name__ == "__main__":
    main()
