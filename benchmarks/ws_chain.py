"""Spike: the bs-1 matmul chain as one persistent, warp-specialized launch (Gluon, sm_90), whose
weight loads never wait for an activation.

Every dependent form of the chain measured before streamed the weights slower than the launch
chain (``persistent_spike.py``, ``flow_chain.py``): in a Triton loop the pipeliner issues a
step's weight and activation loads together, so a matmul's weight loads cannot start before the
previous matmul's output is there. Here each program is two partitions:

- a **producer** warp walks the program's units (phase, ``BN`` weight rows, whole K) in chain
  order and TMA-loads their ``[BN, BK]`` weight tiles into a ring of ``STAGES`` shared-memory
  slots. It waits only for a free slot, never for an activation, so it runs ahead across the
  matmul boundaries by up to the ring's depth;
- a **consumer** partition waits for the previous phase (its count of finished units, acquire),
  copies the phase's three input rows into shared memory (``cp.async``, every K step in flight at
  once), then for each K step takes the slot, multiplies on the CUDA cores into per-lane fp32
  sums, frees the slot, and at a unit's end reduces and stores its ``BN`` outputs; its units of
  the phase are counted once (release).

Units are dealt round the programs continuing from where the last phase stopped (unit ``u`` to
program ``u % P``, :func:`first_unit`), so the small matmuls' tiles fall on different programs.

The chain: 16 layers x (q+k+v, o, gate+up, down), then the LM head, of the 1.1B Llama-like model,
at 3 rows; phase ``p`` reads the first ``K_p`` columns of the rows phase ``p - 1`` wrote, rounded
to bf16 (no attention, norm or SiLU: a spike of the streaming, not a verify step). Against, in one
process: the same chain as one ``skinny_linear_triton`` launch a matmul (today's lowering), the
kernel without the waits (``ws_free``: not a valid chain; its rate when nothing waits), without
the waits or the multiplies (``ws_ring``: the weight ring's own rate), and a plain read of the
same bytes. Every valid chain is checked against torch (each matmul in float32 from the 16-bit
rows, rounded to bf16) and every unit must be counted once.

    python benchmarks/ws_chain.py [--tiles 16x512 32x256] [--stages 8 10] [--warps 8] [--layer]
        [--mma] [--warp-release]

``--warp-release`` runs each form again with every consumer warp taking and handing back the
ring's slots on its own (:func:`take_slot`, :func:`give_slot`), and with ``--mma`` the
tensor-core units whose warps' partials are added a group of units at a time
(:func:`_mma_phase`).

``--layer`` gives the phases the layer's input transforms, done on the staged rows once a phase
and program: the residual add + RMSNorm before q+k+v, gate+up and the LM head (the program holding
a phase's first unit writes the next residual), SiLU-and-mul before down; against the launches
with those in their prologues and the gate+up epilogue, as the lowering fuses them.

Needs an sm_90 GPU and triton's Gluon (3.6 and 3.9 both build it). Writes ``ws_chain.json``
(``ws_chain_layer.json`` with ``--layer``) to ``$OUT`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

sys.path.insert(0, str(Path(__file__).parent))
from persistent_spike import _rel_err as rel_err, phases  # noqa: E402

KS = (2048, 8192)  # the chain's K values: one TMA view of the weights each
SPIN_MAX = 1 << 20
# triton 3.6 / 3.9 names: a barrier of the calling partition's warps; a cp.async copy; a TMA
# load
_sync = getattr(gl, "thread_barrier", None) or gl.barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
TIMING = dict(eager_iters=3, graph_calls=1, graph_replays=20)


@gluon.jit
def _view_36(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _view_39(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    return smem.reinterpret(dtype, shape, layout)


# a shared-memory buffer seen as another dtype, shape and layout (triton 3.6 / 3.9 names)
as_view = (_view_39 if hasattr(gl.shared_memory_descriptor, "reinterpret") else _view_36)


@gluon.jit
def _phase(tab_ptr, p, COLS: gl.constexpr):
    """Phase ``p``'s first eight columns of a table of ``COLS`` (``WsChain.tab``: 8): (first
    weight row in its K's TMA view, N, K, first unit, input half, input kind, gamma row, norm
    index); int32 (the host checks they fit)."""
    base = tab_ptr + p * COLS
    return (gl.load(base).to(gl.int32), gl.load(base + 1).to(gl.int32),
            gl.load(base + 2).to(gl.int32), gl.load(base + 3).to(gl.int32),
            gl.load(base + 4).to(gl.int32), gl.load(base + 5).to(gl.int32),
            gl.load(base + 6).to(gl.int32), gl.load(base + 7).to(gl.int32))


@gluon.jit
def _l2_prefetch(w_ptr, row, k, BN: gl.constexpr):
    """``prefetch.global.L2`` of a unit's ``BN`` whole weight rows from row ``row`` of its K's
    ``[rows, k]`` view (``BN * k`` contiguous bf16), a 128-byte line a lane at a time."""
    LL: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=LL)
    base = w_ptr + row.to(gl.int64) * k
    for j in range(0, BN * k // 64, 32):  # 64 bf16 a line
        gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base + (j + lane) * 64], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _producer(d2k, d8k, tab_ptr, w_ring, full, empty, num_phases, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, COLS: gl.constexpr, w_ptr,
              LOOK: gl.constexpr):
    """Every K step of the program's units, in order: a free slot, then its weight tile's TMA
    load. It waits for nothing else, so it runs ahead across the phases by the ring's depth (a
    phase of N 0 has no weights).

    With ``LOOK`` (bytes), before each unit's loads it also keeps its own units up to ``LOOK``
    bytes past the ring prefetched into L2 (a second cursor over the same units). As a way to
    keep HBM streaming while the consumers wait it lost (every form measured slower:
    docs/benchmarks.md); it stays as a stress of the ring: refills then come from L2, soon after
    a slot's release, while the prefetches crowd the SM's load pipe, so a slot released before
    its reads have landed shows up as a different output from step to step."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    it = 0
    # the lookahead's cursor (phase pp, unit tp) and its bytes past the units loaded
    pp = 0
    r0, n0, k0, start0, h0, kind0, g0, nidx0 = _phase(tab_ptr, 0, COLS)
    tp = (pid - start0 % nprog + nprog) % nprog
    ahead = 0
    for p in range(num_phases):
        row0, n, k, ustart, half, kind, grow, nidx = _phase(tab_ptr, p, COLS)
        for t in range((pid - ustart % nprog + nprog) % nprog, n // BN, nprog):
            r = row0 + t * BN
            if LOOK > 0:
                ahead -= BN * k * 2
                while (ahead < LOOK) & (pp < num_phases):
                    prow, pn, pk, pstart, ph, pkind, pg, pnidx = _phase(tab_ptr, pp, COLS)
                    if tp < pn // BN:
                        _l2_prefetch(w_ptr, prow + tp * BN, pk, BN)
                        ahead += BN * pk * 2
                        tp += nprog
                    else:
                        pp += 1
                        q = pp - (pp >= num_phases).to(gl.int32)
                        qrow, qn, qk, qstart, qh, qkind, qg, qnidx = _phase(tab_ptr, q, COLS)
                        tp = (pid - qstart % nprog + nprog) % nprog
            for kk in range(0, k, BK):
                slot = it % STAGES
                mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(slot), BN * BK * 2)
                if k == 8192:
                    _tma_load(d8k, [r, kk], full.index(slot), w_ring.index(slot))
                else:
                    _tma_load(d2k, [r, kk], full.index(slot), w_ring.index(slot))
                it += 1


@gluon.jit
def _norm_row(x_smem, rin, rout, i, r, hidden, xcol, WRITE: gl.constexpr, BK: gl.constexpr):
    """Row ``r``'s K step ``i``: ``h = bf16(staged + residual)`` back into the staged slot
    (and, ``WRITE``, to the next residual); returns ``h^2`` in fp32."""
    slot = x_smem.index(i * 3 + r)
    h = (slot.load(xcol.type.layout).to(gl.float32)
         + gl.load(rin + r * hidden + i * BK + xcol).to(gl.float32)).to(gl.bfloat16)
    slot.store(h)
    if WRITE:
        gl.store(rout + r * hidden + i * BK + xcol, h)
    hf = h.to(gl.float32)
    return hf * hf


@gluon.jit
def _scale_row(x_smem, gamma_ptr, i, r, rstd, xcol, BK: gl.constexpr):
    """Row ``r``'s K step ``i``: ``gamma * bf16(h * rstd)`` (HF's RMSNorm in 16-bit), in place."""
    slot = x_smem.index(i * 3 + r)
    h = slot.load(xcol.type.layout).to(gl.float32)
    g = gl.load(gamma_ptr + i * BK + xcol).to(gl.float32)
    slot.store((g * (h * rstd).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _stage_norm(x_smem, resid_ptr, gamma_ptr, k, hidden, eps, grow, nidx, writer, xcol,
                BK: gl.constexpr):
    """The staged rows become the next matmul's input ``RMSNorm(residual + rows)``; the program
    holding the phase's first unit writes ``residual + rows`` as the next residual (the
    residuals alternate between two buffers, norm phase by norm phase). Its residual and gamma
    loads are plain loads, a K step at a time (measured: the cost of this form)."""
    rin = resid_ptr + (nidx % 2) * 3 * hidden
    rout = resid_ptr + ((nidx + 1) % 2) * 3 * hidden
    ss0 = gl.zeros_like(xcol).to(gl.float32)
    ss1 = gl.zeros_like(xcol).to(gl.float32)
    ss2 = gl.zeros_like(xcol).to(gl.float32)
    for i in range(0, k // BK):
        if writer:
            ss0 += _norm_row(x_smem, rin, rout, i, 0, hidden, xcol, True, BK)
            ss1 += _norm_row(x_smem, rin, rout, i, 1, hidden, xcol, True, BK)
            ss2 += _norm_row(x_smem, rin, rout, i, 2, hidden, xcol, True, BK)
        else:
            ss0 += _norm_row(x_smem, rin, rout, i, 0, hidden, xcol, False, BK)
            ss1 += _norm_row(x_smem, rin, rout, i, 1, hidden, xcol, False, BK)
            ss2 += _norm_row(x_smem, rin, rout, i, 2, hidden, xcol, False, BK)
    r0 = gl.rsqrt(gl.sum(ss0, axis=0) / k + eps)
    r1 = gl.rsqrt(gl.sum(ss1, axis=0) / k + eps)
    r2 = gl.rsqrt(gl.sum(ss2, axis=0) / k + eps)
    g = gamma_ptr + grow * hidden
    for i in range(0, k // BK):
        _scale_row(x_smem, g, i, 0, r0, xcol, BK)
        _scale_row(x_smem, g, i, 1, r1, xcol, BK)
        _scale_row(x_smem, g, i, 2, r2, xcol, BK)
    _sync()


@gluon.jit
def _stage_silu(x_smem, up_ptr, width, k, xcol, BK: gl.constexpr):
    """The staged rows (the gate half) become ``silu(gate) * up``, ``up`` the columns from ``k``
    on of the same rows (plain loads, a K step at a time)."""
    for i in range(0, k // BK):
        for r in gl.static_range(3):
            slot = x_smem.index(i * 3 + r)
            g = slot.load(xcol.type.layout).to(gl.float32)
            u = gl.load(up_ptr + r * width + i * BK + xcol).to(gl.float32)
            slot.store((g / (1.0 + gl.exp(-g)) * u).to(gl.bfloat16))
    _sync()


@gluon.jit
def wait_phase(counter_ptr, err_ptr, p, units, SPIN: gl.constexpr):
    """Until phase ``p - 1`` has counted its ``units`` (acquire); past ``SPIN`` polls, flags
    ``err`` and goes on."""
    seen = gl.atomic_add(counter_ptr + p - 1, 0, sem="acquire")
    spins = 0
    while (seen < units) & (spins < SPIN):
        seen = gl.atomic_add(counter_ptr + p - 1, 0, sem="acquire")
        spins += 1
    if spins >= SPIN:
        gl.store(err_ptr, 1)


# The per-warp hand-over of a ring slot (``WREL``). Triton 3.6 orders an ``mbarrier.wait`` and an
# ``mbarrier.arrive`` with every shared-memory access around them by a barrier of the whole
# partition, and its ``arrive`` comes from the partition's thread 0: each slot then costs two
# barriers of the 8 consumer warps, which move in lock step. In this form each thread polls the
# slot's full barrier itself and each warp hands the slot back on its own (its lanes' proxy
# fences, a warp barrier, lane 0's arrive; the empty barrier counts the warps), so a warp runs on
# to the next slot while the others finish this one. Inline PTX, addressed from the shared
# window's base ``global_smem`` by the barrier arrays' byte offsets, which the host reads from a
# first build (:func:`ring_barriers`).
_TAKE_ASM = gl.constexpr("""{
.reg .pred %%ready;
.reg .b32 %%bar;
mov.u32 %%bar, global_smem;
add.u32 %%bar, %%bar, $1;
take_wait:
mbarrier.try_wait.parity.shared::cta.b64 %%ready, [%%bar], $2;
@!%%ready bra.uni take_wait;
mov.u32 $0, 0;
}""".replace("%%", "%"))
_GIVE_ASM = gl.constexpr("""{
.reg .pred %%lead;
.reg .b32 %%bar, %%lane;
fence.proxy.async.shared::cta;
bar.warp.sync -1;
mov.u32 %%lane, %laneid;
setp.eq.u32 %%lead, %%lane, 0;
mov.u32 %%bar, global_smem;
add.u32 %%bar, %%bar, $1;
@%%lead mbarrier.arrive.shared::cta.b64 _, [%%bar];
mov.u32 $0, 0;
}""".replace("%%", "%"))


@gluon.jit
def _per_thread(CW: gl.constexpr):
    """A zero for each thread of a ``CW``-warp partition (an inline asm's operand: it runs once
    a thread)."""
    return gl.full([32 * CW], 0, gl.int32, gl.BlockedLayout([1], [32], [CW], [0]))


@gluon.jit
def take_slot(full, slot, phase, WREL: gl.constexpr, FULL0: gl.constexpr, CW: gl.constexpr):
    """Until ring slot ``slot``'s fill of phase ``phase`` has landed: Gluon's wait, or with
    ``WREL`` each thread's own poll of the barrier at byte ``FULL0 + 8 slot``."""
    if WREL:
        z = _per_thread(CW)
        gl.inline_asm_elementwise(_TAKE_ASM, "=r,r,r", [z + (FULL0 + 8 * slot), z + phase],
                                  dtype=gl.int32, is_pure=False, pack=1)
    else:
        mbarrier.wait(full.index(slot), phase)


@gluon.jit
def give_slot(empty, slot, WREL: gl.constexpr, EMPTY0: gl.constexpr, CW: gl.constexpr):
    """Hand ring slot ``slot`` back: :func:`release_slot`, or with ``WREL`` each warp on its own
    (every lane's proxy fence, a warp barrier, lane 0's arrive on the barrier at byte
    ``EMPTY0 + 8 slot``, which counts ``CW`` arrivals)."""
    if WREL:
        gl.inline_asm_elementwise(_GIVE_ASM, "=r,r", [_per_thread(CW) + (EMPTY0 + 8 * slot)],
                                  dtype=gl.int32, is_pure=False, pack=1)
    else:
        release_slot(empty, slot)


def ring_barriers(ptx: str, stages: int, warps: int) -> tuple[int, int]:
    """Byte offsets in the shared window of a build's first full and first empty ring barrier,
    from its PTX's ``mbarrier.init``s (full: count 1; empty: count ``warps``, the per-warp form),
    each array ``stages`` barriers 8 bytes apart."""
    import re

    base = set(re.findall(r"mov\.b32\s+(%r\d+), global_smem;", ptx))
    at = {}
    for dst, src, off in re.findall(r"add\.s32\s+(%r\d+), (%r\d+), (\d+);", ptx):
        if src in base:
            at[dst] = int(off)
    for reg in base:
        at[reg] = 0
    inits = {}
    for addr, count in re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64 \[([^\]]+)\], (\d+);",
                                  ptx):
        m = re.fullmatch(r"global_smem(?:\+(\d+))?", addr)
        off = int(m.group(1) or 0) if m else at.get(addr)
        if off is None:
            raise ValueError(f"an mbarrier.init at {addr}, not at a constant offset")
        inits.setdefault(int(count), set()).add(off)
    full, empty = sorted(inits.get(1, ())), sorted(inits.get(warps, ()))
    for name, offs in (("full", full), ("empty", empty)):
        if len(offs) != stages or offs != list(range(offs[0], offs[0] + 8 * stages, 8)):
            raise ValueError(f"the ring's {name} barriers at {offs}: not {stages} in a row")
    return full[0], empty[0]


_BARRIERS: dict = {}


def launch_ring(kernel, grid: tuple, args: tuple, consts: dict, stages: int, warps: int,
                wrel: bool):
    """Launch a ring kernel (constexprs ``WREL``, ``FULL0``, ``EMPTY0``); with ``wrel``, the
    barrier offsets from a first build of the same constexprs (cached), checked again in the
    build that runs."""
    if not wrel:
        return kernel[grid](*args, WREL=False, FULL0=0, EMPTY0=0, **consts)
    key = (kernel.__name__, tuple(sorted((k, v) for k, v in consts.items()
                                         if not isinstance(v, torch.Tensor))))
    if key not in _BARRIERS:
        first = kernel.warmup(*args, WREL=True, FULL0=0, EMPTY0=0, grid=grid, **consts)
        _BARRIERS[key] = ring_barriers(first.asm["ptx"], stages, warps)
        full0, empty0 = _BARRIERS[key]
        built = kernel[grid](*args, WREL=True, FULL0=full0, EMPTY0=empty0, **consts)
        if ring_barriers(built.asm["ptx"], stages, warps) != (full0, empty0):
            raise RuntimeError("the ring's barriers moved between two builds")
        return built
    full0, empty0 = _BARRIERS[key]
    return kernel[grid](*args, WREL=True, FULL0=full0, EMPTY0=empty0, **consts)


@gluon.jit
def release_slot(empty, slot):
    """Hand ring slot ``slot`` back to the producer once every consumer warp is done with it.
    The slot was read by the generic proxy (shared-memory loads) and the producer refills it
    through the async proxy (TMA), so a proxy fence comes first: a barrier alone lets a refill
    from L2 land before a warp's loads have returned (the unit then multiplies part of the next
    tile). Called after the slot's multiplies, whose loads have landed by then."""
    fence_async_shared()
    _sync()  # every warp has read the slot
    mbarrier.arrive(empty.index(slot))


@gluon.jit
def _consumer(tab_ptr, act_ptr, counter_ptr, err_ptr, resid_ptr, gamma_ptr, w_ring, full, empty,
              x_smem, num_phases, width, hidden, eps, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, WAIT: gl.constexpr, SPIN: gl.constexpr, CW: gl.constexpr,
              MATH: gl.constexpr, LAYER: gl.constexpr, MMA: gl.constexpr, WREL: gl.constexpr,
              FULL0: gl.constexpr, EMPTY0: gl.constexpr):
    """Per phase with units here: wait for the last phase (``WAIT``: its count, acquire), copy
    its three rows into shared memory (``cp.async``, all K steps in flight at once); per unit,
    its K steps from the ring (each slot handed back after its multiplies: :func:`release_slot`),
    then its 16-bit outputs; the program's units of the phase counted once (release)."""
    # [BN, BK]: a warp spans 256 of K, the warps stacked along N (warps side by side along K,
    # so that each input row is read from shared memory once, not once a warp, measured slower:
    # the reduction across warps at each unit's end costs more than the reads it saves)
    WL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [CW, 1], [1, 0])
    XL: gl.constexpr = gl.SliceLayout(0, WL)  # [BK]
    AL: gl.constexpr = gl.SliceLayout(1, WL)  # [BN]
    SL: gl.constexpr = gl.BlockedLayout([8], [32], [CW], [0])  # [BK] copies
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    width = gl.multiple_of(width, 16)
    offs_n = gl.arange(0, BN, layout=AL)
    xcol = gl.arange(0, BK, layout=SL)
    it = 0
    prev_n = 0
    for p in range(num_phases):
        row0, n, k, ustart, half, kind, grow, nidx = _phase(tab_ptr, p, 8)
        first = (pid - ustart % nprog + nprog) % nprog
        if first < n // BN:
            if WAIT:
                if p > 0:  # every unit of the previous phase counted (acquire)
                    wait_phase(counter_ptr, err_ptr, p, prev_n // BN, SPIN)
            _sync()  # nobody still reads the last phase's rows
            src = act_ptr + half * 3 * width
            for i in range(0, k // BK):
                for r in gl.static_range(3):
                    _async_load(x_smem.index(i * 3 + r), src + r * width + i * BK + xcol)
            async_copy.commit_group()
            async_copy.wait_group(0)
            _sync()
            if LAYER:  # the input's own transform, on the staged rows
                if kind == 1:
                    _stage_norm(x_smem, resid_ptr, gamma_ptr, k, hidden, eps, grow, nidx,
                                first == 0, xcol, BK)
                elif kind == 2:
                    _stage_silu(x_smem, src + k, width, k, xcol, BK)
            dst = act_ptr + (1 - half) * 3 * width
            done = 0
            if MMA >= 2:
                if (MMA == 3) and (k == 4 * BK):  # the phase's B operands built once
                    b0, b1, b2, b3 = mma_b_operands(x_smem, 3, 1, BK, CW)
                    it, done = _mma_phase(w_ring, full, empty, x_smem, k, it, dst, width, first,
                                          n // BN, b0, b1, b2, b3, BN, BK, STAGES, CW, FULL0,
                                          EMPTY0, True)
                else:
                    it, done = _mma_phase(w_ring, full, empty, x_smem, k, it, dst, width, first,
                                          n // BN, 0, 0, 0, 0, BN, BK, STAGES, CW, FULL0,
                                          EMPTY0, False)
            elif MMA == 1:
                for t in range(first, n // BN, nprog):
                    it = _mma_unit(w_ring, full, empty, x_smem, k, it, dst + t * BN, width, BN,
                                   BK, STAGES, CW, WREL, FULL0, EMPTY0)
                    done += 1
            else:
                for t in range(first, n // BN, nprog):
                    # per-lane partial sums over the unit's K steps, reduced once at its end
                    acc0 = gl.zeros([BN, BK], gl.float32, WL)
                    acc1 = gl.zeros([BN, BK], gl.float32, WL)
                    acc2 = gl.zeros([BN, BK], gl.float32, WL)
                    for kk in range(0, k, BK):
                        slot = it % STAGES
                        take_slot(full, slot, (it // STAGES) & 1, WREL, FULL0, CW)
                        if MATH:
                            w = w_ring.index(slot).load(WL).to(gl.float32)
                            xs = (kk // BK) * 3
                            acc0 += w * x_smem.index(xs).load(XL).to(gl.float32)[None, :]
                            acc1 += w * x_smem.index(xs + 1).load(XL).to(gl.float32)[None, :]
                            acc2 += w * x_smem.index(xs + 2).load(XL).to(gl.float32)[None, :]
                        give_slot(empty, slot, WREL, EMPTY0, CW)
                        it += 1
                    out = dst + t * BN + offs_n
                    gl.store(out, gl.sum(acc0, axis=1).to(gl.bfloat16))
                    gl.store(out + width, gl.sum(acc1, axis=1).to(gl.bfloat16))
                    gl.store(out + 2 * width, gl.sum(acc2, axis=1).to(gl.bfloat16))
                    done += 1
            _sync()  # every thread's stores issued before the count
            gl.atomic_add(counter_ptr + p, done, sem="release")
        prev_n = n


@gluon.constexpr_function
def _mma_layout(cw):
    """``mma.sync`` m16n8k16's fp32 sums over ``[cw, 16, 8]``: warp ``j`` its own ``[16, 8]``."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[cw, 1, 1],
                                     instr_shape=[1, 16, 8])


@gluon.constexpr_function
def _mma_operand(cw, index):
    """The A (``index`` 0: a slot's weight chunks) or B (1: the rows) operand's layout of
    :func:`_mma_layout`."""
    return gl.DotOperandLayout(operand_index=index, parent=_mma_layout(cw), k_width=2)


@gluon.jit
def _mma_unit(w_ring, full, empty, x_smem, k, it, out, width, BN: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr, WREL: gl.constexpr,
              FULL0: gl.constexpr, EMPTY0: gl.constexpr):
    """One unit on the tensor cores (``mma.sync`` m16n8k16, bf16 in, fp32 sums): warp ``j``
    takes the slot's ``j``-th 128-byte column chunk (``BK / CW`` of K; the slot, TMA-written
    as ``[BN, BK]`` with 128-byte swizzle, read as ``[CW, BN, BK / CW]``) times the three rows'
    same columns as B (its columns 3-7 zero); the warps' sums are added at the unit's end and
    its three rows of ``BN`` outputs stored at ``out``."""
    KC: gl.constexpr = BK // CW
    MMA: gl.constexpr = _mma_layout(CW)
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    chunks: gl.constexpr = gl.NVMMASharedLayout(128, 16, rank=3)
    acc = gl.zeros([CW, BN, 8], gl.float32, MMA)
    for kk in range(0, k, BK):
        slot = it % STAGES
        take_slot(full, slot, (it // STAGES) & 1, WREL, FULL0, CW)
        a = as_view(w_ring.index(slot), gl.bfloat16, [CW, BN, KC], chunks).load(
            _mma_operand(CW, 0))
        acc = mma_v2(a, _mma_b(x_smem, (kk // BK) * 3, 1, CW, KC, _mma_operand(CW, 1)), acc)
        give_slot(empty, slot, WREL, EMPTY0, CW)
        it += 1
    tot = gl.sum(acc, axis=0)  # [BN, 8]: column r is row r's outputs
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, OL))[None, :]
    offs = gl.arange(0, BN, layout=gl.SliceLayout(1, OL))
    for r in gl.static_range(3):
        gl.store(out + r * width + offs,
                 gl.sum(gl.where(cols == r, tot, 0.0), axis=1).to(gl.bfloat16))
    return it


# the tensor-core units with the warps' sums added at the end of a group of PART_UNITS units
# (:func:`_mma_phase`): each warp's [BN, 3] partial of a unit goes to shared memory by inline PTX,
# so no partition barrier orders it, and a group's sums are read back, added in warp order and
# stored once every warp has passed one barrier
PART_UNITS = gl.constexpr(8)
_PART_ST_ASM = gl.constexpr("""{
.reg .pred %%keep;
.reg .b32 %%at;
setp.lt.s32 %%keep, $3, 3;
mov.u32 %%at, global_smem;
add.u32 %%at, %%at, $1;
@%%keep st.shared.b32 [%%at], $2;
mov.u32 $0, 0;
}""".replace("%%", "%"))


def _part_sum_asm(warps: int, stride: int) -> str:
    """PTX that adds ``warps`` fp32 words ``stride`` bytes apart from byte ``$1`` of the shared
    window, in order."""
    lines = ["{", ".reg .b32 %at;", ".reg .f32 %v;", "mov.u32 %at, global_smem;",
             "add.u32 %at, %at, $1;", "ld.shared.f32 $0, [%at];"]
    for w in range(1, warps):
        lines += [f"ld.shared.f32 %v, [%at+{w * stride}];", "add.f32 $0, $0, %v;"]
    return "\n".join(lines + ["}"])


_PART_SUM_ASM = gl.constexpr(_part_sum_asm(8, 16 * 3 * 4))


@gluon.jit
def _mma_b(x_smem, xs, xrow, CW: gl.constexpr, KC: gl.constexpr, BL: gl.constexpr):
    """The B operand of one K step whose row ``r`` is staged in slot ``xs + r * xrow`` (this
    chain stages K step ``i`` of row ``r`` in slot ``3 i + r``: ``xs = 3 i``, ``xrow = 1``;
    ws_step stages a row's K steps together: ``xs = i``, ``xrow = K / BK``): ``[CW, KC, 8]``,
    column ``r < 3`` row ``r``'s columns of each warp's chunk, columns 3-7 zero."""
    XS: gl.constexpr = gl.SliceLayout(2, BL)
    col = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))[None, None, :]
    x0 = x_smem.index(xs).reshape([CW, KC]).load(XS)[:, :, None]
    x1 = x_smem.index(xs + xrow).reshape([CW, KC]).load(XS)[:, :, None]
    x2 = x_smem.index(xs + 2 * xrow).reshape([CW, KC]).load(XS)[:, :, None]
    return gl.where(col == 0, x0, gl.where(col == 1, x1, gl.where(col == 2, x2, 0.0))).to(
        gl.bfloat16)


@gluon.jit
def mma_b_operands(x_smem, xstep, xrow, BK: gl.constexpr, CW: gl.constexpr):
    """The B operands of a phase's four K steps (:func:`_mma_b`; K step ``i`` of row ``r`` in
    slot ``i xstep + r xrow``), built once for all its units when its K is four slots
    (``CACHED`` in :func:`_mma_partial`)."""
    BL: gl.constexpr = _mma_operand(CW, 1)
    KC: gl.constexpr = BK // CW
    return (_mma_b(x_smem, 0, xrow, CW, KC, BL), _mma_b(x_smem, xstep, xrow, CW, KC, BL),
            _mma_b(x_smem, 2 * xstep, xrow, CW, KC, BL),
            _mma_b(x_smem, 3 * xstep, xrow, CW, KC, BL))


@gluon.jit
def _mma_slot(w_ring, full, empty, it, acc, b, STAGES: gl.constexpr, BN: gl.constexpr,
              KC: gl.constexpr, CW: gl.constexpr, FULL0: gl.constexpr, EMPTY0: gl.constexpr):
    """One slot's products into ``acc``, each warp taking and handing back the slot itself."""
    chunks: gl.constexpr = gl.NVMMASharedLayout(128, 16, rank=3)
    slot = it % STAGES
    take_slot(full, slot, (it // STAGES) & 1, True, FULL0, CW)
    a = as_view(w_ring.index(slot), gl.bfloat16, [CW, BN, KC], chunks).load(_mma_operand(CW, 0))
    acc = mma_v2(a, b, acc)
    give_slot(empty, slot, True, EMPTY0, CW)
    return acc


@gluon.jit
def _mma_partial(w_ring, full, empty, x_smem, xstep, xrow, k, it, block, b0, b1, b2, b3,
                 BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr,
                 FULL0: gl.constexpr, EMPTY0: gl.constexpr, CACHED: gl.constexpr):
    """One unit on the tensor cores, each warp on its own: warp ``j`` multiplies the ``j``-th
    128-byte column chunk of every slot (as :func:`_mma_unit`), takes and hands back the slots
    itself (:func:`take_slot`, :func:`give_slot`), and writes its ``[BN, 3]`` fp32 partial to
    the unit's block of partials at byte ``block`` of the shared window (``[CW, BN, 3]``),
    through inline PTX, which no barrier orders. ``CACHED``: K is four slots and ``b0``-``b3``
    are their B operands (:func:`mma_b_operands`); else each slot's is built from the staged
    rows, K step ``i`` of row ``r`` in slot ``i xstep + r xrow``. Returns the ring's
    position."""
    KC: gl.constexpr = BK // CW
    MMA: gl.constexpr = _mma_layout(CW)
    BL: gl.constexpr = _mma_operand(CW, 1)
    wi = gl.arange(0, CW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))[:, None, None]
    ri = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))[None, :, None]
    ci = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))[None, None, :]
    zero = gl.zeros([CW, BN, 8], gl.int32, MMA)
    acc = gl.zeros([CW, BN, 8], gl.float32, MMA)
    if CACHED:
        acc = _mma_slot(w_ring, full, empty, it, acc, b0, STAGES, BN, KC, CW, FULL0, EMPTY0)
        acc = _mma_slot(w_ring, full, empty, it + 1, acc, b1, STAGES, BN, KC, CW, FULL0, EMPTY0)
        acc = _mma_slot(w_ring, full, empty, it + 2, acc, b2, STAGES, BN, KC, CW, FULL0, EMPTY0)
        acc = _mma_slot(w_ring, full, empty, it + 3, acc, b3, STAGES, BN, KC, CW, FULL0, EMPTY0)
        it += 4
    else:
        for kk in range(0, k, BK):
            acc = _mma_slot(w_ring, full, empty, it, acc,
                            _mma_b(x_smem, (kk // BK) * xstep, xrow, CW, KC, BL), STAGES, BN,
                            KC, CW, FULL0, EMPTY0)
            it += 1
    gl.inline_asm_elementwise(_PART_ST_ASM, "=r,r,r,r",
                              [zero + (block + ((wi * BN + ri) * 3 + ci) * 4), acc, zero + ci],
                              dtype=gl.int32, is_pure=False, pack=1)
    return it


@gluon.jit
def part_sum(at):
    """The ``CW`` warps' partials of one output added in warp order: ``at`` (a tensor of byte
    offsets in the shared window) is warp 0's word of it in a unit's block."""
    return gl.inline_asm_elementwise(_PART_SUM_ASM, "=f,r", [at], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def _mma_phase(w_ring, full, empty, x_smem, k, it, dst, width, first, units, b0, b1, b2, b3,
               BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr,
               FULL0: gl.constexpr, EMPTY0: gl.constexpr, CACHED: gl.constexpr):
    """A phase's units on the tensor cores, each warp on its own (:func:`_mma_partial`;
    ``CACHED``: with the phase's B operands ``b0``-``b3``), :data:`PART_UNITS` units a group; at
    a group's end the partials are added in warp order and the three rows stored
    (:func:`_flush_partials`). Returns the ring's position and the units done."""
    PB: gl.constexpr = CW * BN * 3 * 4  # a unit's partials, bytes
    SCR0: gl.constexpr = EMPTY0 + 8 * STAGES
    nprog = gl.num_programs(0)
    done = 0
    g0 = first  # the group's first unit
    for t in range(first, units, nprog):
        it = _mma_partial(w_ring, full, empty, x_smem, 3, 1, k, it,
                          SCR0 + (done % PART_UNITS) * PB, b0, b1, b2, b3, BN, BK, STAGES, CW,
                          FULL0, EMPTY0, CACHED)
        done += 1
        if done % PART_UNITS == 0:
            _flush_partials(dst, width, g0, PART_UNITS, nprog, SCR0, BN, CW)
            g0 = t + nprog
    if done % PART_UNITS != 0:
        _flush_partials(dst, width, g0, done % PART_UNITS, nprog, SCR0, BN, CW)
    return it, done


@gluon.jit
def _flush_partials(dst, width, g0, count, nprog, SCR0: gl.constexpr, BN: gl.constexpr,
                    CW: gl.constexpr):
    """A group of ``count`` units from unit ``g0`` (every ``nprog``-th): once every warp has
    written its partials, each output is its ``CW`` partials added in warp order, stored to its
    row (bf16); then a barrier, so the next group's partials overwrite none still read."""
    FL: gl.constexpr = gl.BlockedLayout([1], [32], [CW], [0])
    _sync()
    e = gl.arange(0, PART_UNITS * BN * 4, layout=FL)
    u = e // (BN * 4)
    r = (e // 4) % BN
    c = e % 4
    at = SCR0 + ((u * CW * BN + r) * 3 + gl.minimum(c, 2)) * 4  # column 3: none, kept in the block
    v = part_sum(at)
    gl.store(dst + c * width + (g0 + u * nprog) * BN + r, v.to(gl.bfloat16),
             mask=(c < 3) & (u < count))
    _sync()


@gluon.jit
def ring_and_rows(desc, STAGES: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                  KSTEPS: gl.constexpr, GIVERS: gl.constexpr, SCRATCH: gl.constexpr):
    """The weight ring (``STAGES`` slots of ``[BN, BK]`` in the TMA descriptor ``desc``'s layout),
    its full mbarriers (count 1) and empty ones (count ``GIVERS``: 1, or the consumer warps when
    each hands a slot back on its own), followed by ``SCRATCH`` bytes that only inline PTX
    touches (:func:`_mma_phase`'s partials, at ``EMPTY0 + 8 STAGES``), and the rows' staging
    buffer ``[3 KSTEPS, BK]`` (a slot indexable at run time)."""
    w_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES + SCRATCH // 8, 1],
                                      mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=GIVERS)
    fence_async_shared()
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [KSTEPS * 3, BK],
                                       gl.SwizzledSharedLayout(8, 1, 1, [0]))
    return w_ring, full, empty, x_smem


@gluon.jit
def _ws_chain_kernel(d2k, d8k, tab_ptr, act_ptr, counter_ptr, err_ptr, resid_ptr, gamma_ptr,
                     num_phases, width, hidden, eps, BN: gl.constexpr, BK: gl.constexpr,
                     STAGES: gl.constexpr, KSTEPS: gl.constexpr, WAIT: gl.constexpr,
                     SPIN: gl.constexpr, MATH: gl.constexpr, LAYER: gl.constexpr,
                     MMA: gl.constexpr, w_ptr, LOOK: gl.constexpr, WREL: gl.constexpr,
                     FULL0: gl.constexpr, EMPTY0: gl.constexpr, num_warps: gl.constexpr):
    # a group's partials (PART_UNITS units x the warps x [BN, 3] fp32) for the grouped form
    SCR: gl.constexpr = PART_UNITS * num_warps * BN * 12 if MMA >= 2 else 0
    w_ring, full, empty, x_smem = ring_and_rows(d2k, STAGES, BN, BK, KSTEPS,
                                                num_warps if WREL else 1, SCR)
    gl.warp_specialize([
        (_consumer, (tab_ptr, act_ptr, counter_ptr, err_ptr, resid_ptr, gamma_ptr, w_ring, full,
                     empty, x_smem, num_phases, width, hidden, eps, BN, BK, STAGES, WAIT, SPIN,
                     num_warps, MATH, LAYER, MMA, WREL, FULL0, EMPTY0)),
        (_producer, (d2k, d8k, tab_ptr, w_ring, full, empty, num_phases, BN, BK, STAGES, 8, w_ptr,
                     LOOK)),
    ], [1], [40])


def first_unit(pid: int, programs: int, ustart: int) -> int:
    """The first of a phase's units program ``pid`` of ``programs`` takes, the phase's units
    numbered on from ``ustart`` (the kernels' expression): unit ``t`` goes to program
    ``(ustart + t) % programs``."""
    return (pid - ustart % programs + programs) % programs


def layer_phases(layers: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The 1.1B model's layers as phases with their input transforms (kinds: 1 the residual
    add + RMSNorm, 2 SiLU-and-mul, 0 none): q+k+v (norm), o (none: the attention's output is
    stood in for by q's columns), gate+up (norm), down (SiLU), then the LM head (norm)."""
    shapes = [(4096, 2048), (2048, 2048), (16384, 2048), (2048, 8192)] * layers + [(32000, 2048)]
    return shapes, [1, 0, 1, 2] * layers + [1]


def pack_weights(shapes: list[tuple[int, int]], device: str,
                 gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    """The ``[N, K]`` weights of ``shapes`` (normal, std ``K ** -0.5``) one after another in one
    flat bf16 buffer, padded to a whole row of the largest K; returns it and each one's offset
    (a multiple of its K, so that it is a row range of its K's ``[rows, K]`` view)."""
    sizes = [n * k for n, k in shapes]
    w = torch.zeros(-(-sum(sizes) // max(KS)) * max(KS), dtype=torch.bfloat16, device=device)
    offs, o = [], 0
    for (n, k), size in zip(shapes, sizes):
        if o % k:
            raise ValueError(f"weight offset {o} is not a multiple of its K {k}")
        w[o:o + size].normal_(0.0, k ** -0.5, generator=gen)
        offs.append(o)
        o += size
    return w, offs


def weight_descriptors(w: torch.Tensor, bn: int, bk: int) -> list:
    """One TMA descriptor of ``[bn, bk]`` tiles over ``w`` viewed as ``[rows, K]``, for each K of
    :data:`KS`."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    return [TensorDescriptor(w.view(-1, k), [w.numel() // k, k], [k, 1], [bn, bk], layout)
            for k in KS]


class WsChain:
    """The chain's weights (one flat bf16 buffer, a TMA view for each K), its phase table, two
    halves of three bf16 rows (a phase reads one, writes the other) and, with input transforms
    (``kinds``), two residual buffers and a gamma row per norm phase."""

    def __init__(self, shapes: list[tuple[int, int]], device: str, seed: int = 0,
                 bn: int = 32, bk: int = 256, kinds: list[int] | None = None) -> None:
        self.bn, self.bk = bn, bk
        kinds = kinds or [0] * len(shapes)
        if len(kinds) != len(shapes) or any(c not in (0, 1, 2) for c in kinds):
            raise ValueError(f"kinds {kinds}: one of 0 (none), 1 (norm), 2 (SiLU) a phase")
        for i, ((n, k), kind) in enumerate(zip(shapes, kinds)):
            need = k * (2 if kind == 2 else 1)
            if k not in KS or n % bn or (i and need > shapes[i - 1][0]) or k % bk:
                raise ValueError(f"phase {i} is {n} x {k}: K must be one of {KS}, N a multiple "
                                 f"of {bn}, and K (2 K for a SiLU input) at most the last "
                                 "phase's N")
        hiddens = {k for (n, k), kind in zip(shapes, kinds) if kind == 1}
        if len(hiddens) > 1:
            raise ValueError(f"norm phases of K {sorted(hiddens)}: one residual width only")
        g = torch.Generator(device).manual_seed(seed)
        self.shapes, self.kinds = shapes, kinds
        self.w, offs = pack_weights(shapes, device, g)
        self.offs = offs
        self.width = -(-max(n for n, _ in shapes) // 16) * 16
        self.hidden = hiddens.pop() if hiddens else 16
        rows, ustart, norms = [], 0, 0
        for i, ((n, k), off, kind) in enumerate(zip(shapes, offs, kinds)):
            rows.append((off // k, n, k, ustart, i % 2, kind, norms if kind == 1 else 0, norms))
            ustart += n // bn
            norms += kind == 1
        if max(max(r) for r in rows) >= 2**31:
            raise ValueError("a phase table entry does not fit int32")
        self.tab = torch.tensor(rows, dtype=torch.int64, device=device)
        self.act = torch.zeros(2 * 3 * self.width, dtype=torch.bfloat16, device=device)
        self.resid = torch.zeros(2 * 3 * self.hidden, dtype=torch.bfloat16, device=device)
        self.gammas = (1.0 + 0.1 * torch.randn(max(norms, 1), self.hidden, generator=g,
                                               device=device)).to(torch.bfloat16)
        self.eps = 1e-6
        self.descs = weight_descriptors(self.w, bn, bk)
        self.counter = torch.zeros(len(shapes), dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)
        self.units = [n // bn for n, _ in shapes]

    @property
    def layer(self) -> bool:
        return any(self.kinds)

    def weight(self, i: int) -> torch.Tensor:
        n, k = self.shapes[i]
        return self.w[self.offs[i]:self.offs[i] + n * k].view(n, k)

    def _half(self, h: int) -> torch.Tensor:
        return self.act[h * 3 * self.width:(h + 1) * 3 * self.width].view(3, self.width)

    def set_input(self, x: torch.Tensor) -> None:
        """``x [3, K0]``: the first phase's rows, or with input transforms the first residual
        (the embeddings; the rows before it are zeros)."""
        self.act.zero_()
        self.resid.zero_()
        if self.layer:
            self.resid[:3 * self.hidden].view(3, self.hidden)[:, :x.shape[1]] = x
        else:
            self._half(0)[:, :x.shape[1]] = x

    def output(self) -> torch.Tensor:
        return self._half(len(self.shapes) % 2)[:, :self.shapes[-1][0]]

    def run(self, programs: int, stages: int, wait: bool = True, num_warps: int = 8,
            math: bool = True, mma: int = 0, look: int = 0, wrel: bool = False) -> None:
        """One chain; ``mma``: the units on the tensor cores (16 x 512 tiles, 8 consumer warps,
        no input transforms), 1 each unit's warps' sums added at its end (:func:`_mma_unit`), 2
        a group of units at a time (:func:`_mma_phase`, with ``wrel``), 3 the same with a
        four-slot phase's B operands built once (:func:`mma_b_operands`); ``look``: the
        producer's L2 lookahead in bytes, a stress of the ring (:func:`_producer`); ``wrel``:
        each consumer warp takes and hands back the ring's slots on its own
        (:func:`take_slot`, :func:`give_slot`)."""
        if mma and (self.bn != 16 or self.bk != 64 * num_warps or self.layer):
            raise ValueError(f"the tensor-core units take 16 x {64 * num_warps} tiles and no "
                             f"input transforms, not {self.bn} x {self.bk} (layer {self.layer})")
        if mma >= 2 and (not wrel or num_warps != 8):
            raise ValueError("the tensor-core units with the partials added a group at a time "
                             "(mma 2, 3) take the per-warp hand-over (wrel) and 8 consumer warps")
        self.counter.zero_()
        launch_ring(_ws_chain_kernel, (programs,), (
            self.descs[0], self.descs[1], self.tab, self.act, self.counter, self.err,
            self.resid, self.gammas, len(self.shapes), self.width, self.hidden, self.eps),
            dict(BN=self.bn, BK=self.bk, STAGES=stages, KSTEPS=max(KS) // self.bk, WAIT=wait,
                 SPIN=SPIN_MAX, MATH=math, LAYER=self.layer, MMA=mma, w_ptr=self.w, LOOK=look,
                 num_warps=num_warps), stages, num_warps, wrel)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Torch, phase by phase: each input transform in fp32 rounded as HF rounds it, each
        matmul in fp32 from the 16-bit rows, rounded to bf16."""
        prev = torch.zeros(3, self.width, dtype=torch.bfloat16, device=x.device)
        resid = x
        if not self.layer:
            prev[:, :x.shape[1]] = x
        norms = 0
        for i, ((n, k), kind) in enumerate(zip(self.shapes, self.kinds)):
            if kind == 1:
                h = (resid.float() + prev[:, :k].float()).to(torch.bfloat16)
                resid = h
                hf = h.float()
                normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps))
                a = (self.gammas[norms].float() * normed.to(torch.bfloat16).float())
                a = a.to(torch.bfloat16)
                norms += 1
            elif kind == 2:
                a = (torch.nn.functional.silu(prev[:, :k].float()) * prev[:, k:2 * k].float())
                a = a.to(torch.bfloat16)
            else:
                a = prev[:, :k]
            y = (a.float() @ self.weight(i).float().T).to(torch.bfloat16)
            prev = torch.zeros_like(prev)
            prev[:, :n] = y
        return prev[:, :self.shapes[-1][0]]


def skinny_chain(chain: WsChain, x: torch.Tensor) -> torch.Tensor:
    """The chain as one ``skinny_linear_triton`` launch a matmul (today's lowering): with input
    transforms, the residual add + norm as a launch's prologue and the SiLU as the gate+up
    launch's epilogue (``glu_out``), as ``fuse_linears`` makes them."""
    from dspark_compile.kernels.skinny import skinny_linear_triton

    if not chain.layer:
        a = x
        for i, (n, k) in enumerate(chain.shapes):
            a = skinny_linear_triton(a[:, :k], chain.weight(i), weight_settled=True)[0]
        return a
    resid, prev, norms = x, None, 0
    for i, ((n, k), kind) in enumerate(zip(chain.shapes, chain.kinds)):
        nxt = chain.kinds[i + 1] if i + 1 < len(chain.kinds) else 0
        if kind == 1:
            y, h = skinny_linear_triton(resid, chain.weight(i), None, chain.gammas[norms],
                                        chain.eps, False, prev, nxt == 2, weight_settled=True)
            resid = h if prev is not None else resid
            norms += 1
        elif kind == 2:
            y = skinny_linear_triton(prev, chain.weight(i), weight_settled=True)[0]
        else:
            y = skinny_linear_triton(prev[:, :k], chain.weight(i), weight_settled=True)[0]
        prev = y
    return prev


def graph_ms(fn) -> float:
    """ms a call of ``fn`` in CUDA-graph replays (:data:`TIMING`)."""
    from common import time_calls

    return time_calls([fn], TIMING, "cuda")["graph_us"] / 1e3


def read_ms(w: torch.Tensor, sms: int) -> float:
    """ms for a plain read of ``w`` (``hbm_read.py``'s kernel, two programs a multiprocessor)."""
    from hbm_read import _read_kernel

    sink = torch.empty(2 * sms, device=w.device, dtype=torch.float32)
    return graph_ms(lambda: _read_kernel[(2 * sms,)](w, sink, w.numel(), BLOCK=16384,
                                                     num_warps=8))


def reporter(name: str, **settings):
    """A result file ``name`` in ``common.out_dir()`` with the versions, the command and
    ``settings``; returns it and ``emit(row)``, which prints the row and rewrites the file."""
    from common import out_dir, versions, write_json

    report = dict(**versions(), command=" ".join(sys.argv), **settings, timing=TIMING,
                  results=[])
    out = out_dir()

    def emit(row: dict) -> None:
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        write_json(out, name, report)

    return report, emit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--stages", type=int, nargs="+", default=[8, 10])
    ap.add_argument("--tiles", nargs="+", default=["16x512", "32x256"],
                    help="weight tiles a ring slot holds, BNxBK")
    ap.add_argument("--warps", type=int, nargs="+", default=[8])
    ap.add_argument("--mma", action="store_true",
                    help="the units on the tensor cores too (16x512 tiles, 8 warps): ws_mma, "
                         "ws_mma_free")
    ap.add_argument("--warp-release", action="store_true",
                    help="each form also with every consumer warp taking and handing back the "
                         "ring's slots on its own (take_slot / give_slot): kinds *_wrel")
    ap.add_argument("--layer", action="store_true",
                    help="the layers' input transforms too: the residual add + RMSNorm before "
                         "q+k+v, gate+up and the LM head, SiLU-and-mul before down "
                         "(ws_chain_layer.json)")
    opts = ap.parse_args()
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes, kinds = layer_phases(opts.layers) if opts.layer else (phases(opts.layers), None)
    nbytes = sum(n * k for n, k in shapes) * 2
    _, write = reporter("ws_chain_layer.json" if opts.layer else "ws_chain.json", rows=3,
                        layers=opts.layers, layer_transforms=opts.layer, weight_bytes=nbytes,
                        sms=sms)

    def emit(row: dict) -> None:
        row["tb_per_s"] = nbytes / (row["ms"] * 1e-3) / 1e12
        write(row)

    for b, tile in enumerate(opts.tiles):
        bn, bk = map(int, tile.split("x"))
        chain = WsChain(shapes, dev, bn=bn, bk=bk, kinds=kinds)
        x = torch.randn(3, shapes[0][1], device=dev,
                        generator=torch.Generator(dev).manual_seed(1)).to(torch.bfloat16)
        want = chain.reference(x)
        if b == 0:
            emit(dict(kind="read", ms=read_ms(chain.w, sms)))
            got = skinny_chain(chain, x)
            emit(dict(kind="skinny", rel_err=rel_err(got, want),
                      ms=graph_ms(lambda: skinny_chain(chain, x))))
        for warps in opts.warps:
            for stages in opts.stages:
                if stages * bn * bk * 2 + 3 * max(KS) * 2 > 220 * 1024:
                    continue  # the ring and the rows past the H200's shared memory
                # a valid chain; the same without the waits (not valid: the stream's rate);
                # without the waits or the math (the weight ring's own rate)
                forms = [("ws", True, True, False), ("ws_free", False, True, False),
                         ("ws_ring", False, False, False)]
                if opts.mma and (bn, bk, warps) == (16, 512, 8) and not opts.layer:
                    forms += [("ws_mma", True, True, 1), ("ws_mma_free", False, True, 1)]
                forms = [f + (False,) for f in forms]
                if opts.warp_release:
                    forms += [(f[0] + "_wrel", *f[1:4], True) for f in forms]
                    if opts.mma and (bn, bk, warps) == (16, 512, 8) and not opts.layer:
                        forms += [("ws_mma_grouped", True, True, 2, True),
                                  ("ws_mma_grouped_free", False, True, 2, True),
                                  ("ws_mma_grouped_b", True, True, 3, True),
                                  ("ws_mma_grouped_b_free", False, True, 3, True)]
                for kind, wait, math, mma, wrel in forms:
                    chain.set_input(x)
                    chain.err.zero_()
                    chain.run(sms, stages, wait, warps, math, mma, wrel=wrel)
                    torch.cuda.synchronize()
                    counts = chain.units
                    row = dict(kind=kind, bn=bn, bk=bk, stages=stages, warps=warps, programs=sms,
                               timed_out=bool(chain.err.item()),
                               counts_ok=chain.counter.tolist() == counts)
                    if wait:
                        row["rel_err"] = rel_err(chain.output(), want)
                    row["ms"] = graph_ms(lambda s=stages, wt=wait, nw=warps, m=math, mm=mma,
                                      w=wrel: chain.run(sms, s, wt, nw, m, mm, wrel=w))
                    emit(row)
        del chain
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
