"""Spike: the whole bs-1 verify step of the 1.1B Llama-like model (3 rows, context 1024, paged
KV) as one persistent, warp-specialized launch (Gluon, sm_90), whose weight stream keeps running
through the norms, the attention and every phase boundary.

``ws_chain.py`` showed the matmul chain alone at 0.90x of the launches once the weight loads
live in a partition of their own; today's bs-1 step leaves the memory bus idle during each
layer's attention launches. Here every op of a layer is a phase of one launch:

- **q+k+v** (RMSNorm of the residual stream on the staged rows; in the epilogue, rotary on q
  and k and the new k and v into the paged cache), **attention**, **o**, **gate+up**
  (RMSNorm; SiLU-and-mul in the epilogue), **down**; then the final norm and the **LM head**;
- a matmul phase's units are (``BN`` weight rows, whole K) as in ``ws_chain.py``: the producer
  warp TMA-loads their tiles into the ring, never waiting for an activation. The rows (for a
  norm phase the residual and the gamma too) are copied into shared memory in one ``cp.async``
  burst. A unit's two halves of ``BN / 2`` rows are summed apart, so that the epilogues pair
  them in registers: the weight rows are ordered so that a q or k unit holds a head's columns
  and their rotary partners, and a gate+up unit gate columns and the same up columns;
- an **attention** phase's units are (KV head, split of the ``ctx + 3`` positions): each unit
  loads its cached K and V before waiting for the q+k+v phase, then the new positions and the
  two q heads x three tokens; each warp scores its own positions (causal) and keeps its own
  (max, sum, output) in registers, the warps' are combined through shared memory into the
  unit's partial, and the split that counts last for its KV head merges the splits into the o
  phase's rows. Attention phases have no weights, so the producer keeps filling the ring with
  the o and gate+up tiles while they run.

Phases wait for the previous phase's unit count (acquire), as in ``ws_chain.py``; data crossing
programs is read through L2 (``cp.async.cg`` or ``.cg`` loads). The output, the logits of the
three rows, is checked against torch doing the same math phase by phase (each matmul in fp32
from the 16-bit rows, rounded to bf16; rotary, softmax in fp32), every unit must be counted once
and every KV head merged once. Not in the launch: the embedding gather (its rows are the first
residual) and the argmax.

    python benchmarks/ws_step.py [--layers 16] [--splits 16] [--skips 0 1 2 8] [--probe]
        [--stress N] [--hand-over cta warp]

``--hand-over warp`` runs the step with every consumer warp taking and handing back the ring's
slots on its own (``ws_chain.take_slot`` / ``give_slot``) instead of the 8 warps at a barrier;
``warp_mma`` the same with the matmuls on the tensor cores, the warps' partials added a group
of units at a time (``ws_chain._mma_partial``); ``warp_mma_b`` with a four-slot phase's B
operands built once.
``--skips`` adds runs without the waits that leave work out (bits: 1 the attention, 2 the norms,
8 the matmuls' math), ``--probe`` a step with each program's phase times and each phase's share
of the step, ``--stress`` the distinct outputs of N steps, plain and under the ring's stress
(:data:`STRESS_LOOK`), ``--ncu`` three steps and nothing else (for Nsight Compute). Compare with
``python benchmarks/verify_step.py --quick --bs 1`` in the same session (the compiled step: the
same model at ragged mean 3). Needs an sm_90 GPU and triton's Gluon (3.6 and 3.9 both build it).
Writes ``ws_step.json`` to ``$OUT`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

sys.path.insert(0, str(Path(__file__).parent))
from ws_chain import (KS, PART_UNITS, SPIN_MAX, _async_load, _mma_partial,  # noqa: E402
                      _phase, _producer, _sync, as_view, give_slot, graph_ms, launch_ring,
                      mma_b_operands, pack_weights, part_sum, read_ms, rel_err, reporter,
                      ring_and_rows, take_slot, wait_phase, weight_descriptors)

COLS = gl.constexpr(12)  # phase table columns (see WsStep.tab)
NORM, ATTN = 1, 3  # phase kinds (0: a plain matmul)
LOG2E = gl.constexpr(1.4426950408889634)
# the 1.1B model
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 8192, 16, 8, 128, 32000
ROWS = 3  # bs 1, three tokens verified


@gluon.jit
def _step_phase(tab_ptr, p):
    """Columns 8-10 of phase ``p``: (epilogue, units, layer)."""
    base = tab_ptr + p * COLS
    return (gl.load(base + 8).to(gl.int32), gl.load(base + 9).to(gl.int32),
            gl.load(base + 10).to(gl.int32))


@gluon.jit
def _stage(x_smem, src, width, resid_ptr, gamma_ptr, k, eps, kind, grow, nidx, writer,
           BK: gl.constexpr, NORM_ON: gl.constexpr, HID: gl.constexpr, CW: gl.constexpr):
    """The phase's three rows ``[3, k]`` into shared memory, row after row (row ``r``'s K step
    ``i`` in slot ``r k / BK + i``), by ``cp.async`` of ``HID / BK`` slots at a time (each thread
    16 bytes of a copy, none copied twice); a norm phase's residual rows (slots ``3 HID / BK``
    on) and gamma (``6 HID / BK`` on) in the same burst. Then, for a norm phase, the rows become
    ``gamma * bf16(h * rstd)``, ``h = bf16(rows + residual)``, loaded whole row by row, and the
    program holding the phase's first unit writes ``h`` as the next residual (two buffers,
    alternating)."""
    KN: gl.constexpr = HID // BK  # slots a copy
    CL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [KN, CW // KN], [1, 0])  # [KN, BK]
    chunks = as_view(x_smem, gl.bfloat16, [x_smem.shape[0] // KN, KN, BK],
                     gl.SwizzledSharedLayout(8, 1, 1, [1, 0]))
    ci = gl.arange(0, KN, layout=gl.SliceLayout(1, CL))[:, None] * BK
    cj = gl.arange(0, BK, layout=gl.SliceLayout(0, CL))[None, :]
    per_row = k // (KN * BK)  # copies a row
    for r in gl.static_range(3):
        for c in range(0, per_row):
            _async_load(chunks.index(r * per_row + c), src + r * width + c * HID + ci + cj)
    if NORM_ON:
        norm = kind == 1
    else:
        norm = kind < 0
    rin = resid_ptr + (nidx % 2) * 3 * HID
    if norm:
        for r in gl.static_range(3):
            _async_load(chunks.index(3 + r), rin + r * HID + ci + cj)
        _async_load(chunks.index(6), gamma_ptr + grow * HID + ci + cj)
    async_copy.commit_group()
    async_copy.wait_group(0)
    _sync()
    if norm:
        rout = resid_ptr + ((nidx + 1) % 2) * 3 * HID
        keep = ((ci + cj) >= 0) & writer
        h0 = _resid_row(chunks, 0, rout, ci + cj, keep, CL, HID)
        h1 = _resid_row(chunks, 1, rout, ci + cj, keep, CL, HID)
        h2 = _resid_row(chunks, 2, rout, ci + cj, keep, CL, HID)
        g = chunks.index(6).load(CL).to(gl.float32)
        _sync()  # every thread has read the rows it rewrites
        _norm_store(chunks, 0, h0, g, eps, HID)
        _norm_store(chunks, 1, h1, g, eps, HID)
        _norm_store(chunks, 2, h2, g, eps, HID)
        _sync()


@gluon.jit
def _resid_row(chunks, r, rout, offs, keep, CL: gl.constexpr, HID: gl.constexpr):
    """Row ``r``: ``h = bf16(staged row + staged residual)`` (also stored as the next residual
    where ``keep``), in fp32."""
    h = (chunks.index(r).load(CL).to(gl.float32)
         + chunks.index(3 + r).load(CL).to(gl.float32)).to(gl.bfloat16)
    gl.store(rout + r * HID + offs, h, mask=keep)
    return h.to(gl.float32)


@gluon.jit
def _norm_store(chunks, r, h, g, eps, HID: gl.constexpr):
    """Row ``r`` of the matmul's input: ``gamma * bf16(h * rstd)`` (HF's RMSNorm in 16-bit)."""
    rstd = gl.rsqrt(gl.sum(gl.sum(h * h, axis=1), axis=0) / HID + eps)
    chunks.index(r).store((g * (h * rstd).to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _matmuls(w_ring, full, empty, x_smem, dst, width, k, first, units, epi, it, ctx, layer,
             pages_per_layer, kc_ptr, vc_ptr, bt_ptr, cos_ptr, sin_ptr, BN: gl.constexpr,
             BK: gl.constexpr, STAGES: gl.constexpr, CW: gl.constexpr, NH: gl.constexpr,
             NKV: gl.constexpr, HD: gl.constexpr, PAGE: gl.constexpr, MATH: gl.constexpr,
             WREL: gl.constexpr, FULL0: gl.constexpr, EMPTY0: gl.constexpr, MMA: gl.constexpr):
    """The program's units of a matmul phase, then their epilogues: ``epi`` 0 stores both
    halves, 1 SiLU-and-mul (gate half, up half), 2 rotary and the KV cache (:func:`_qkv_rows`).
    ``MMA`` 0: each unit's sums on the CUDA cores (:func:`_unit_sums`), its rotary tables and
    cache rows loaded when it starts; 2: on the tensor cores, each warp on its own, the warps'
    partials added :data:`ws_chain.PART_UNITS` units at a time (:func:`_group_epilogues`)."""
    HB: gl.constexpr = BN // 2
    WL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [CW, 1], [1, 0])  # [HB, BK]
    AL: gl.constexpr = gl.SliceLayout(1, WL)
    nprog = gl.num_programs(0)
    offs = gl.arange(0, HB, layout=AL)
    done = 0
    if MMA >= 2:
        if (MMA == 3) and (k == 4 * BK):  # the phase's B operands built once
            b0, b1, b2, b3 = mma_b_operands(x_smem, 1, k // BK, BK, CW)  # rows staged whole
            it, done = _grouped_units(w_ring, full, empty, x_smem, dst, width, k, first, units,
                                      epi, it, ctx, layer, pages_per_layer, kc_ptr, vc_ptr,
                                      bt_ptr, cos_ptr, sin_ptr, offs, b0, b1, b2, b3, BN, BK,
                                      STAGES, CW, NH, NKV, HD, PAGE, FULL0, EMPTY0, True)
        else:
            it, done = _grouped_units(w_ring, full, empty, x_smem, dst, width, k, first, units,
                                      epi, it, ctx, layer, pages_per_layer, kc_ptr, vc_ptr,
                                      bt_ptr, cos_ptr, sin_ptr, offs, 0, 0, 0, 0, BN, BK, STAGES,
                                      CW, NH, NKV, HD, PAGE, FULL0, EMPTY0, False)
    else:
        for t in range(first, units, nprog):
            if epi == 2:
                (c1, cs1_0, sn1_0, cs2_0, sn2_0, cs1_1, sn1_1, cs2_1, sn2_1, cs1_2, sn1_2, cs2_2,
                 sn2_2, crow0, crow1, crow2) = _qkv_tables(cos_ptr, sin_ptr, bt_ptr, t, ctx,
                                                           layer, pages_per_layer, offs, HB, HD,
                                                           PAGE)
                it, a0, b0, a1, b1, a2, b2 = _unit_sums(w_ring, full, empty, x_smem, k, it, HB,
                                                        BK, STAGES, CW, MATH, WREL, FULL0,
                                                        EMPTY0)
                _qkv_rows(dst, width, t, a0, b0, a1, b1, a2, b2, c1, cs1_0, sn1_0, cs2_0, sn2_0,
                          cs1_1, sn1_1, cs2_1, sn2_1, cs1_2, sn1_2, cs2_2, sn2_2, crow0, crow1,
                          crow2, kc_ptr, vc_ptr, offs, HB, NH, NKV, HD)
            else:
                it, a0, b0, a1, b1, a2, b2 = _unit_sums(w_ring, full, empty, x_smem, k, it, HB,
                                                        BK, STAGES, CW, MATH, WREL, FULL0,
                                                        EMPTY0)
                _out_rows(dst, width, t, a0, b0, a1, b1, a2, b2, epi, offs, HB)
            done += 1
    return it, done


@gluon.jit
def _grouped_units(w_ring, full, empty, x_smem, dst, width, k, first, units, epi, it, ctx, layer,
                   pages_per_layer, kc_ptr, vc_ptr, bt_ptr, cos_ptr, sin_ptr, offs, b0, b1, b2,
                   b3, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   CW: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr,
                   PAGE: gl.constexpr, FULL0: gl.constexpr, EMPTY0: gl.constexpr,
                   CACHED: gl.constexpr):
    """A phase's units on the tensor cores, each warp on its own (``ws_chain._mma_partial``;
    ``CACHED``: with the phase's B operands ``b0``-``b3``), their epilogues run a group of
    :data:`ws_chain.PART_UNITS` at a time (:func:`_group_epilogues`). Returns the ring's
    position and the units done."""
    PB: gl.constexpr = CW * BN * 3 * 4  # a unit's partials, bytes
    SCR0: gl.constexpr = EMPTY0 + 8 * STAGES
    nprog = gl.num_programs(0)
    done = 0
    g0 = first
    for t in range(first, units, nprog):
        # _stage puts K step i of row r in slot r k / BK + i (ws_chain's own: 3 i + r)
        it = _mma_partial(w_ring, full, empty, x_smem, 1, k // BK, k, it,
                          SCR0 + (done % PART_UNITS) * PB, b0, b1, b2, b3, BN, BK, STAGES, CW,
                          FULL0, EMPTY0, CACHED)
        done += 1
        if done % PART_UNITS == 0:
            _group_epilogues(dst, width, g0, PART_UNITS, nprog, epi, ctx, layer,
                             pages_per_layer, kc_ptr, vc_ptr, bt_ptr, cos_ptr, sin_ptr, offs,
                             SCR0, BN, CW, NH, NKV, HD, PAGE)
            g0 = t + nprog
    if done % PART_UNITS != 0:
        _group_epilogues(dst, width, g0, done % PART_UNITS, nprog, epi, ctx, layer,
                         pages_per_layer, kc_ptr, vc_ptr, bt_ptr, cos_ptr, sin_ptr, offs, SCR0,
                         BN, CW, NH, NKV, HD, PAGE)
    return it, done


@gluon.jit
def _qkv_tables(cos_ptr, sin_ptr, bt_ptr, t, ctx, layer, pages_per_layer, offs, HB: gl.constexpr,
                HD: gl.constexpr, PAGE: gl.constexpr):
    """What q+k+v unit ``t``'s epilogue reads: its columns ``c1`` of a head's first half, each
    row's 16-bit cos and sin there and ``HD / 2`` on (positions ``ctx + r``), and the three
    positions' paged cache rows."""
    UPH: gl.constexpr = (HD // 2) // HB  # q or k units a head
    c1 = (t % UPH) * HB + offs
    tab = ctx * HD + c1
    return (c1, gl.load(cos_ptr + tab), gl.load(sin_ptr + tab),
            gl.load(cos_ptr + tab + HD // 2), gl.load(sin_ptr + tab + HD // 2),
            gl.load(cos_ptr + tab + HD), gl.load(sin_ptr + tab + HD),
            gl.load(cos_ptr + tab + HD + HD // 2), gl.load(sin_ptr + tab + HD + HD // 2),
            gl.load(cos_ptr + tab + 2 * HD), gl.load(sin_ptr + tab + 2 * HD),
            gl.load(cos_ptr + tab + 2 * HD + HD // 2), gl.load(sin_ptr + tab + 2 * HD + HD // 2),
            _cache_row(bt_ptr, layer, ctx, pages_per_layer, PAGE),
            _cache_row(bt_ptr, layer, ctx + 1, pages_per_layer, PAGE),
            _cache_row(bt_ptr, layer, ctx + 2, pages_per_layer, PAGE))


@gluon.jit
def _qkv_rows(dst, width, t, a0, b0, a1, b1, a2, b2, c1, cs1_0, sn1_0, cs2_0, sn2_0, cs1_1,
              sn1_1, cs2_1, sn2_1, cs1_2, sn1_2, cs2_2, sn2_2, crow0, crow1, crow2, kc_ptr,
              vc_ptr, offs, HB: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr,
              HD: gl.constexpr):
    """q+k+v unit ``t``'s three rows (:func:`_qkv_row`) from their halves' sums and
    :func:`_qkv_tables`."""
    _qkv_row(dst, width, 0, t, a0, b0, c1, cs1_0, sn1_0, cs2_0, sn2_0, crow0, kc_ptr, vc_ptr,
             offs, HB, NH, NKV, HD)
    _qkv_row(dst, width, 1, t, a1, b1, c1, cs1_1, sn1_1, cs2_1, sn2_1, crow1, kc_ptr, vc_ptr,
             offs, HB, NH, NKV, HD)
    _qkv_row(dst, width, 2, t, a2, b2, c1, cs1_2, sn1_2, cs2_2, sn2_2, crow2, kc_ptr, vc_ptr,
             offs, HB, NH, NKV, HD)


@gluon.jit
def _out_rows(dst, width, t, a0, b0, a1, b1, a2, b2, epi, offs, HB: gl.constexpr):
    """Unit ``t``'s three rows (:func:`_out_row`) from their halves' sums."""
    _out_row(dst, t, a0, b0, epi, offs, HB)
    _out_row(dst + width, t, a1, b1, epi, offs, HB)
    _out_row(dst + 2 * width, t, a2, b2, epi, offs, HB)


@gluon.jit
def _group_epilogues(dst, width, g0, count, nprog, epi, ctx, layer, pages_per_layer, kc_ptr,
                     vc_ptr, bt_ptr, cos_ptr, sin_ptr, offs, SCR0: gl.constexpr,
                     BN: gl.constexpr, CW: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr,
                     HD: gl.constexpr, PAGE: gl.constexpr):
    """The epilogues of a group of ``count`` units from unit ``g0`` (every ``nprog``-th), once
    every warp has written its partials: each half's sums are the warps' partials added in warp
    order (``ws_chain.part_sum``); then a barrier, so the next group's partials overwrite none
    still read."""
    HB: gl.constexpr = BN // 2
    PB: gl.constexpr = CW * BN * 3 * 4
    _sync()
    for j in range(0, count):
        t = g0 + j * nprog
        pa = SCR0 + j * PB + offs * 12  # first-half row offs, column (token row) 0, warp 0
        pb = pa + HB * 12
        a0, b0 = part_sum(pa), part_sum(pb)
        a1, b1 = part_sum(pa + 4), part_sum(pb + 4)
        a2, b2 = part_sum(pa + 8), part_sum(pb + 8)
        if epi == 2:
            (c1, cs1_0, sn1_0, cs2_0, sn2_0, cs1_1, sn1_1, cs2_1, sn2_1, cs1_2, sn1_2, cs2_2,
             sn2_2, crow0, crow1, crow2) = _qkv_tables(cos_ptr, sin_ptr, bt_ptr, t, ctx, layer,
                                                       pages_per_layer, offs, HB, HD, PAGE)
            _qkv_rows(dst, width, t, a0, b0, a1, b1, a2, b2, c1, cs1_0, sn1_0, cs2_0, sn2_0,
                      cs1_1, sn1_1, cs2_1, sn2_1, cs1_2, sn1_2, cs2_2, sn2_2, crow0, crow1,
                      crow2, kc_ptr, vc_ptr, offs, HB, NH, NKV, HD)
        else:
            _out_rows(dst, width, t, a0, b0, a1, b1, a2, b2, epi, offs, HB)
    _sync()


@gluon.jit
def _unit_sums(w_ring, full, empty, x_smem, k, it, HB: gl.constexpr, BK: gl.constexpr,
               STAGES: gl.constexpr, CW: gl.constexpr, MATH: gl.constexpr, WREL: gl.constexpr,
               FULL0: gl.constexpr, EMPTY0: gl.constexpr):
    """One unit's K steps from the ring (as ``ws_chain._consumer``: per-lane sums of the
    ``[2 HB, BK]`` slot times each row's K step, the slot released after its multiplies),
    reduced and split into the sums of the slot's first ``HB`` weight rows and of its second
    (``a``, ``b``, a pair for each of the three rows), so that an epilogue can pair the halves in
    registers."""
    WL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [CW, 1], [1, 0])  # [2 HB, BK]
    XL: gl.constexpr = gl.SliceLayout(0, WL)
    acc0 = gl.zeros([2 * HB, BK], gl.float32, WL)
    acc1 = gl.zeros([2 * HB, BK], gl.float32, WL)
    acc2 = gl.zeros([2 * HB, BK], gl.float32, WL)
    for kk in range(0, k, BK):
        slot = it % STAGES
        take_slot(full, slot, (it // STAGES) & 1, WREL, FULL0, CW)
        if MATH:
            wf = w_ring.index(slot).load(WL).to(gl.float32)
            i = kk // BK
            acc0 += wf * x_smem.index(i).load(XL).to(gl.float32)[None, :]
            acc1 += wf * x_smem.index(k // BK + i).load(XL).to(gl.float32)[None, :]
            acc2 += wf * x_smem.index(2 * (k // BK) + i).load(XL).to(gl.float32)[None, :]
        give_slot(empty, slot, WREL, EMPTY0, CW)
        it += 1
    a0, b0 = _halves(gl.sum(acc0, axis=1), HB)
    a1, b1 = _halves(gl.sum(acc1, axis=1), HB)
    a2, b2 = _halves(gl.sum(acc2, axis=1), HB)
    return it, a0, b0, a1, b1, a2, b2


@gluon.jit
def _halves(o, HB: gl.constexpr):
    """``o [2 HB]`` as its first and second halves, each rounded to bf16."""
    return gl.split(gl.permute(gl.reshape(o, [2, HB]), (1, 0)))


@gluon.jit
def _out_row(row, t, a, b, epi, offs, HB: gl.constexpr):
    """A row of unit ``t``'s outputs, its halves' sums ``a`` and ``b`` rounded to bf16: ``epi`` 0
    both stored at ``t BN``; 1 (gate+up: the unit's first half are gate columns, the second the
    same up columns) ``bf16(silu(gate)) * up`` (HF's 16-bit SiLU-and-mul) at ``t BN / 2``."""
    ga = gl.convert_layout(a, offs.type.layout).to(gl.bfloat16)
    gb = gl.convert_layout(b, offs.type.layout).to(gl.bfloat16)
    if epi == 0:
        gl.store(row + t * 2 * HB + offs, ga)
        gl.store(row + t * 2 * HB + HB + offs, gb)
    else:
        g = ga.to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32) * gb.to(gl.float32)
        gl.store(row + t * HB + offs, act.to(gl.bfloat16))


@gluon.jit
def _qkv_row(dst, width, r, t, a, b, c1, cs1, sn1, cs2, sn2, crow, kc_ptr, vc_ptr, offs,
             HB: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr):
    """Row ``r`` of q+k+v unit ``t``: a q or k unit's halves are ``BN / 2`` columns of a head's
    first half and their partners ``HD / 2`` on (the weight rows are ordered so), rotated at
    position ``ctx + r`` (HF's rotate-half, 16-bit cos and sin, fp32 math rounded to bf16), q
    into the attention's rows, k into the paged cache row ``crow``; a v unit's ``BN`` columns
    go into the cache."""
    UPH: gl.constexpr = (HD // 2) // HB
    ga = gl.convert_layout(a, offs.type.layout).to(gl.bfloat16)
    gb = gl.convert_layout(b, offs.type.layout).to(gl.bfloat16)
    if t < (NH + NKV) * UPH:
        hh = t // UPH
        x1 = ga.to(gl.float32)
        x2 = gb.to(gl.float32)
        y1 = (x1 * cs1.to(gl.float32) - x2 * sn1.to(gl.float32)).to(gl.bfloat16)
        y2 = (x2 * cs2.to(gl.float32) + x1 * sn2.to(gl.float32)).to(gl.bfloat16)
        if hh < NH:
            row = dst + r * width + hh * HD
            gl.store(row + c1, y1)
            gl.store(row + HD // 2 + c1, y2)
        else:
            base = kc_ptr + crow * (NKV * HD) + (hh - NH) * HD
            gl.store(base + c1, y1)
            gl.store(base + HD // 2 + c1, y2)
    else:
        base = vc_ptr + crow * (NKV * HD) + (t - (NH + NKV) * UPH) * 2 * HB
        gl.store(base + offs, ga)
        gl.store(base + HB + offs, gb)


@gluon.jit
def _cache_row(bt_ptr, layer, pos, pages_per_layer, PAGE: gl.constexpr):
    """The paged cache's row of position ``pos`` in ``layer`` (its page from the block table)."""
    page = gl.load(bt_ptr + pos // PAGE)
    return (layer * pages_per_layer + page) * PAGE + pos % PAGE


@gluon.jit
def _attention(src, dst, width, first, units, layer, ctx, nsplit, span, sm_scale,
               pages_per_layer, kc_ptr, vc_ptr, bt_ptr, part_ptr, ml_ptr, mcnt_ptr, q_smem,
               a_smem, m_smem, l_smem, wait, counter_ptr, err_ptr, p, prev_units,
               CH: gl.constexpr, MS: gl.constexpr, NKV: gl.constexpr, HD: gl.constexpr,
               PAGE: gl.constexpr, CW: gl.constexpr, SPIN: gl.constexpr,
               PROBE: gl.constexpr):
    """The program's units (KV head, split) of an attention phase. Split ``s`` scores positions
    ``[s span, (s + 1) span)`` of the ``ctx + 3`` (the new tokens' k and v are in the cache
    already, the q rows rotated: the q+k+v epilogue) for the KV head's 2 q heads x 3 tokens,
    causal. The cached positions' K and V are loaded before the wait for the q+k+v phase
    (``wait``), the new ones after. Each warp takes ``CH / CW`` of the positions and keeps its
    own (max, sum, output) a row, in registers: K with a lane a position (a score's sum in the
    lane), V with a lane a column (the output's sum over positions in the lane); the warps' are
    combined through shared memory into the unit's partial; the unit that counts last for its
    KV head (acq_rel) merges the splits, in split order, into the o phase's rows."""
    KW: gl.constexpr = CH // CW  # positions a warp
    LK: gl.constexpr = gl.BlockedLayout([1, 1, HD * KW // 32], [1, KW, 32 // KW], [CW, 1, 1],
                                        [2, 1, 0])  # [CW, KW, HD]
    L3: gl.constexpr = gl.BlockedLayout([1, KW, HD // 32], [1, 1, 32], [CW, 1, 1], [2, 1, 0])
    S2: gl.constexpr = gl.SliceLayout(2, L3)  # [CW, KW]: a warp's positions in each lane
    SK: gl.constexpr = gl.SliceLayout(2, LK)  # [CW, KW]: a position a lane
    QD: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))  # [HD], as L3's last axis
    QK: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, LK))
    QL: gl.constexpr = gl.BlockedLayout([1, HD // 32], [1, 32], [CW, 1], [1, 0])  # [8, HD]
    C2: gl.constexpr = gl.BlockedLayout([CW, 1], [1, 32], [1, CW], [0, 1])  # [CW, HD]
    M3: gl.constexpr = gl.BlockedLayout([1, MS, HD // 32], [1, 1, 32], [CW, 1, 1], [2, 1, 0])
    nprog = gl.num_programs(0)
    rq = gl.arange(0, 8, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, HD, layout=gl.SliceLayout(0, QL))
    wi = gl.arange(0, CW, layout=gl.SliceLayout(1, S2))
    ji = gl.arange(0, KW, layout=gl.SliceLayout(0, S2))
    wk = gl.arange(0, CW, layout=gl.SliceLayout(1, SK))
    jk = gl.arange(0, KW, layout=gl.SliceLayout(0, SK))
    d3 = gl.arange(0, HD, layout=QD)
    dk = gl.arange(0, HD, layout=QK)
    dc = gl.arange(0, HD, layout=gl.SliceLayout(0, C2))
    rm = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, M3)))
    sm = gl.arange(0, MS, layout=gl.SliceLayout(0, gl.SliceLayout(2, M3)))
    dm = gl.arange(0, HD, layout=gl.SliceLayout(0, gl.SliceLayout(1, M3)))
    stride = NKV * HD
    done = 0
    t_go = _now(PROBE)
    for u in range(first, units, nprog):
        kvh = u // nsplit
        s = u % nsplit
        start = s * span
        end = gl.minimum(start + span, ctx + 3)
        # the unit's cached K and V (never written in the launch), before the wait
        pos = start + wi[:, None] * KW + ji[None, :]
        valid = pos < end
        page = gl.load(bt_ptr + pos // PAGE, mask=valid, other=0)
        off = (((layer * pages_per_layer + page) * PAGE + pos % PAGE) * stride
               + kvh * HD)[:, :, None] + d3[None, None, :]
        posk = start + wk[:, None] * KW + jk[None, :]
        validk = posk < end
        pagek = gl.load(bt_ptr + posk // PAGE, mask=validk, other=0)
        offk = (((layer * pages_per_layer + pagek) * PAGE + posk % PAGE) * stride
                + kvh * HD)[:, :, None] + dk[None, None, :]
        old = (valid & (pos < ctx))[:, :, None]
        oldk = (validk & (posk < ctx))[:, :, None]
        kt = gl.load(kc_ptr + offk, mask=oldk, other=0.0, cache_modifier=".cg")
        vt = gl.load(vc_ptr + off, mask=old, other=0.0, cache_modifier=".cg")
        if wait & (u == first):  # every unit of the q+k+v phase counted (acquire)
            wait_phase(counter_ptr, err_ptr, p, prev_units, SPIN)
        _sync()
        if u == first:
            t_go = _now(PROBE)
        # the new positions' K and V (the q+k+v epilogue wrote them), the six q rows (row r:
        # token r % 3 of head 2 kvh + r // 3)
        newk = (validk & (posk >= ctx))[:, :, None]
        new = (valid & (pos >= ctx))[:, :, None]
        kt = gl.where(newk, gl.load(kc_ptr + offk, mask=newk, other=0.0, cache_modifier=".cg"),
                      kt)
        vt = gl.where(new, gl.load(vc_ptr + off, mask=new, other=0.0, cache_modifier=".cg"),
                      vt)
        qoff = (rq % 3)[:, None] * width + (kvh * 2 + rq // 3)[:, None] * HD + dq[None, :]
        q = gl.load(src + qoff, mask=(rq < 6)[:, None], other=0.0, cache_modifier=".cg")
        q_smem.store(q.to(gl.float32) * sm_scale)
        _sync()
        for r in gl.static_range(6):  # each warp its positions: no exchange between warps
            qr = q_smem.slice(r, 1).load(gl.SliceLayout(1, LK))  # [1, HD]
            sc = gl.sum(kt.to(gl.float32) * qr[:, None, :], axis=2)
            sc = gl.where(validk & (posk <= ctx + r % 3), sc, float("-inf"))
            m = gl.max(sc, axis=1)
            pk = gl.exp2((sc - gl.where(m > float("-inf"), m, 0.0)[:, None]) * LOG2E)
            pv = gl.convert_layout(pk, S2)
            a_smem.index(r).store(gl.sum(vt.to(gl.float32) * pv[:, :, None], axis=1))
            m_smem.index(r).store(m)
            l_smem.index(r).store(gl.sum(pk, axis=1))
        _sync()
        pbase = (kvh * nsplit + s) * 8
        for r in gl.static_range(6):  # the warps' partials combined (each thread a column)
            ms = m_smem.index(r).load(gl.SliceLayout(1, C2))
            mx = gl.max(ms, axis=0)
            wts = gl.exp2((ms - mx) * LOG2E)
            acc = gl.sum(a_smem.index(r).load(C2) * wts[:, None], axis=0)
            ls = l_smem.index(r).load(gl.SliceLayout(1, C2))
            gl.store(part_ptr + (pbase + r) * HD + dc, acc)
            gl.store(ml_ptr + (pbase + r) * 2, mx)
            gl.store(ml_ptr + (pbase + r) * 2 + 1, gl.sum(ls * wts, axis=0))
        _sync()  # every thread's partial stored before the count
        seen = gl.atomic_add(mcnt_ptr + layer * NKV + kvh, 1, sem="acq_rel")
        if seen == nsplit - 1:  # the last of the KV head's splits: merge them, one row a warp
            prow = (kvh * nsplit + sm[None, :]) * 8 + rm[:, None]  # [8, MS]
            ok = (rm[:, None] < 6) & (sm[None, :] < nsplit)
            mg = gl.load(ml_ptr + prow * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            lg = gl.load(ml_ptr + prow * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            accs = gl.load(part_ptr + prow[:, :, None] * HD + dm[None, None, :],
                           mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            mxg = gl.max(mg, axis=1)
            wg = gl.exp2((mg - gl.where(mxg > float("-inf"), mxg, 0.0)[:, None]) * LOG2E)
            ro = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(1, M3)))
            den = gl.convert_layout(gl.sum(lg * wg, axis=1), ro.type.layout)
            o = gl.sum(accs * wg[:, :, None], axis=1) / gl.where(den > 0, den, 1.0)[:, None]
            doff = (ro % 3)[:, None] * width + (kvh * 2 + ro // 3)[:, None] * HD + dm[None, :]
            gl.store(dst + doff, o.to(gl.bfloat16), mask=(ro < 6)[:, None])
        done += 1
    return done, t_go


@gluon.jit
def _now(PROBE: gl.constexpr):
    """With ``PROBE``, the SM's ``%globaltimer`` (ns); else 0."""
    if PROBE:
        t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                      is_pure=False, pack=1)
    else:
        t = gl.to_tensor(0).to(gl.int64)
    return t


@gluon.jit
def _consumer(tab_ptr, act_ptr, counter_ptr, err_ptr, resid_ptr, gamma_ptr, kc_ptr, vc_ptr,
              bt_ptr, cos_ptr, sin_ptr, part_ptr, ml_ptr, w_ring, full, empty, x_smem,
              q_smem, a_smem, m_smem, l_smem, num_phases, width, eps, ctx, nsplit, span,
              sm_scale, pages_per_layer, BN: gl.constexpr, BK: gl.constexpr,
              STAGES: gl.constexpr, WAIT: gl.constexpr, SPIN: gl.constexpr, CW: gl.constexpr,
              CH: gl.constexpr, MS: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr,
              HD: gl.constexpr, PAGE: gl.constexpr, SKIP: gl.constexpr, probe_ptr,
              PROBE: gl.constexpr, HID: gl.constexpr, WREL: gl.constexpr, FULL0: gl.constexpr,
              EMPTY0: gl.constexpr, MMA: gl.constexpr):
    """Per phase with units here: wait for the last phase (its count, acquire), then the
    phase's units (matmul or attention), then count them (release). With ``PROBE``, each
    phase's times (``%globaltimer``: arrived, past the wait, counted) into ``probe[pid, p]``."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    width = gl.multiple_of(width, 16)
    mcnt_ptr = counter_ptr + num_phases
    it = 0
    prev_units = 0
    for p in range(num_phases):
        row0, n, k, ustart, half, kind, grow, nidx = _phase(tab_ptr, p, COLS)
        epi, units, layer = _step_phase(tab_ptr, p)
        first = (pid - ustart % nprog + nprog) % nprog
        if first < units:
            t_in = _now(PROBE)
            src = act_ptr + half * 3 * width
            dst = act_ptr + (1 - half) * 3 * width
            if kind == 3:  # waits itself, once its cached K and V are on their way
                if (SKIP & 1) != 0:  # timing only: the attention's units counted, not done
                    done = (units - first + nprog - 1) // nprog
                    t_go = _now(PROBE)
                else:
                    done, t_go = _attention(src, dst, width, first, units, layer, ctx, nsplit, span,
                                      sm_scale, pages_per_layer, kc_ptr, vc_ptr, bt_ptr,
                                      part_ptr, ml_ptr, mcnt_ptr, q_smem, a_smem, m_smem,
                                      l_smem, WAIT & (p > 0), counter_ptr, err_ptr, p,
                                      prev_units, CH, MS, NKV, HD, PAGE, CW, SPIN, PROBE)
            else:
                if WAIT:
                    if p > 0:  # every unit of the previous phase counted (acquire)
                        wait_phase(counter_ptr, err_ptr, p, prev_units, SPIN)
                _sync()  # nobody still reads the last phase's rows
                t_go = _now(PROBE)
                _stage(x_smem, src, width, resid_ptr, gamma_ptr, k, eps, kind, grow, nidx,
                       first == 0, BK, (SKIP & 2) == 0, HID, CW)
                it, done = _matmuls(w_ring, full, empty, x_smem, dst, width, k, first, units,
                                    epi, it, ctx, layer, pages_per_layer, kc_ptr, vc_ptr, bt_ptr,
                                    cos_ptr, sin_ptr, BN, BK, STAGES, CW, NH, NKV, HD, PAGE,
                                    (SKIP & 8) == 0, WREL, FULL0, EMPTY0, MMA)
            _sync()  # every thread's stores issued before the count
            gl.atomic_add(counter_ptr + p, done, sem="release")
            if PROBE:
                at = probe_ptr + (pid * num_phases + p) * 3
                gl.store(at, t_in)
                gl.store(at + 1, t_go)
                gl.store(at + 2, _now(PROBE))
        prev_units = units


@gluon.jit
def _ws_step_kernel(d2k, d8k, tab_ptr, act_ptr, counter_ptr, err_ptr, resid_ptr, gamma_ptr,
                    kc_ptr, vc_ptr, bt_ptr, cos_ptr, sin_ptr, part_ptr, ml_ptr, num_phases,
                    width, eps, ctx, nsplit, span, sm_scale, pages_per_layer,
                    BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                    KSTEPS: gl.constexpr, WAIT: gl.constexpr, SPIN: gl.constexpr,
                    CH: gl.constexpr, MS: gl.constexpr, NH: gl.constexpr, NKV: gl.constexpr,
                    HD: gl.constexpr, PAGE: gl.constexpr, SKIP: gl.constexpr, probe_ptr,
                    PROBE: gl.constexpr, HID: gl.constexpr, w_ptr, LOOK: gl.constexpr,
                    WREL: gl.constexpr, FULL0: gl.constexpr, EMPTY0: gl.constexpr,
                    MMA: gl.constexpr, num_warps: gl.constexpr):
    # with MMA 2, a group's partials (PART_UNITS units x the warps x [BN, 3] fp32)
    SCR: gl.constexpr = PART_UNITS * num_warps * BN * 12 if MMA >= 2 else 0
    w_ring, full, empty, x_smem = ring_and_rows(d2k, STAGES, BN, BK, KSTEPS,
                                                num_warps if WREL else 1, SCR)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    q_smem = gl.allocate_shared_memory(gl.float32, [8, HD],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # the attention's per-warp partials live in the rows' staging buffer, idle while an
    # attention phase runs (its rows are staged again after the phase's count): 32 KB more for
    # the ring
    a_smem = as_view(x_smem, gl.float32, [8, num_warps, HD],
                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    m_smem = gl.allocate_shared_memory(gl.float32, [8, num_warps], flat)
    l_smem = gl.allocate_shared_memory(gl.float32, [8, num_warps], flat)
    gl.warp_specialize([
        (_consumer, (tab_ptr, act_ptr, counter_ptr, err_ptr, resid_ptr, gamma_ptr, kc_ptr,
                     vc_ptr, bt_ptr, cos_ptr, sin_ptr, part_ptr, ml_ptr, w_ring, full, empty,
                     x_smem, q_smem, a_smem, m_smem, l_smem, num_phases, width,
                     eps, ctx, nsplit, span, sm_scale, pages_per_layer, BN, BK, STAGES, WAIT,
                     SPIN, num_warps, CH, MS, NH, NKV, HD, PAGE, SKIP, probe_ptr, PROBE,
                     HID, WREL, FULL0, EMPTY0, MMA)),
        (_producer, (d2k, d8k, tab_ptr, w_ring, full, empty, num_phases, BN, BK, STAGES,
                     COLS, w_ptr, LOOK)),
    ], [1], [40])


def step_phases(layers: int) -> list[tuple[str, int, int, int, int]]:
    """The step's phases (name, N, K, kind, epilogue): per layer q+k+v (norm; rotary and the KV
    cache in its epilogue), attention (no weights), o, gate+up (norm; SiLU-and-mul epilogue),
    down; then the LM head (norm)."""
    layer = [("qkv", HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN, NORM, 2), ("attn", 0, 0, ATTN, 0),
             ("o", HIDDEN, HIDDEN, 0, 0), ("gate_up", 2 * FFN, HIDDEN, NORM, 1),
             ("down", HIDDEN, FFN, 0, 0)]
    return layer * layers + [("head", VOCAB, HIDDEN, NORM, 0)]


class WsStep:
    """The step's weights (one flat bf16 buffer; q+k+v rows ordered so that a unit holds a
    head's columns and their rotary partners, gate+up rows interleaved by unit), phase table,
    activations (two halves of three rows), residuals, gammas, paged KV cache (a shuffled block
    table), rotary tables and the attention's partials."""

    def __init__(self, layers: int, device: str, ctx: int = 1024, splits: int = 16,
                 bn: int = 16, bk: int = 512, page: int = 16, warps: int = 8,
                 seed: int = 0) -> None:
        if bn % 2 or (HEAD_DIM // 2) % (bn // 2) or HIDDEN % bk or FFN % bk:
            raise ValueError(f"tile {bn}x{bk}: BN / 2 dividing {HEAD_DIM // 2}, BK dividing "
                             f"{HIDDEN} and {FFN}")
        self.span = -(-(ctx + ROWS) // splits)  # positions a split
        self.ch = max(warps, triton.next_power_of_2(self.span))
        if (splits - 1) * self.span > ctx:
            raise ValueError(f"{splits} splits of {ctx + ROWS} positions: the last would hold "
                             "none that every row sees")
        self.layers, self.ctx, self.bn, self.bk, self.page = layers, ctx, bn, bk, page
        self.nsplit, self.warps = splits, warps
        g = torch.Generator(device).manual_seed(seed)
        self.phases = step_phases(layers)
        mats = [(n, k) for _, n, k, kind, _ in self.phases if kind != ATTN]
        self.w, offs = pack_weights(mats, device, g)
        self.descs = weight_descriptors(self.w, bn, bk)
        self.mats, self.offs = mats, offs
        rows, ustart, norms, m, lay = [], 0, 0, 0, 0
        for i, (name, n, k, kind, epi) in enumerate(self.phases):
            units = KV_HEADS * self.nsplit if kind == ATTN else n // bn
            row0 = 0 if kind == ATTN else offs[m] // k
            rows.append((row0, n, k, ustart, i % 2, kind, norms if kind == NORM else 0, norms,
                         epi, units, lay, 0))
            ustart += units
            norms += kind == NORM
            m += kind != ATTN
            lay += name == "down"
        self.tab = torch.tensor(rows, dtype=torch.int64, device=device)
        self.units = [r[9] for r in rows]
        self.width = VOCAB
        self.act = torch.zeros(2 * ROWS * self.width, dtype=torch.bfloat16, device=device)
        self.resid = torch.zeros(2 * ROWS * HIDDEN, dtype=torch.bfloat16, device=device)
        self.gammas = (1.0 + 0.1 * torch.randn(norms, HIDDEN, generator=g,
                                               device=device)).to(torch.bfloat16)
        self.eps = 1e-6
        self.pages = -(-(ctx + ROWS) // page) + 3  # a few pages no position uses
        shape = (layers * self.pages * page, KV_HEADS, HEAD_DIM)
        self.kc = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
        self.vc = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
        self.bt = torch.randperm(self.pages, generator=g, device=device).to(torch.int32)
        inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
        ang = torch.arange(ctx + ROWS, device=device).float()[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=1)
        self.cos, self.sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        # a partial (output; max, sum) for 8 rows (6 used) of each (KV head, split)
        self.part = torch.zeros(KV_HEADS * self.nsplit * 8 * HEAD_DIM, device=device)
        self.ml = torch.zeros(KV_HEADS * self.nsplit * 8 * 2, device=device)
        # phase counts, then the merge counts of each (layer, KV head): one memset a step
        self.counter = torch.zeros(len(self.phases) + layers * KV_HEADS, dtype=torch.int32,
                                   device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def kv_bytes(self) -> int:
        """The K and V bytes a step reads: every layer's positions, new ones included."""
        return self.layers * (self.ctx + ROWS) * KV_HEADS * HEAD_DIM * 2 * 2

    def weight(self, m: int) -> torch.Tensor:
        """Matmul ``m``'s ``[N, K]`` weight as the kernel reads it (gate+up interleaved)."""
        n, k = self.mats[m]
        return self.w[self.offs[m]:self.offs[m] + n * k].view(n, k)

    def qkv_columns(self) -> torch.Tensor:
        """The model's q+k+v output column of each weight row the kernel reads: a q or k unit's
        first ``BN / 2`` rows are columns of a head's first half, the rest their partners
        ``HD / 2`` on; the v units' rows in order."""
        half, cols = self.bn // 2, []
        for h in range(HEADS + KV_HEADS):
            for j in range(HEAD_DIM // 2 // half):
                c = h * HEAD_DIM + j * half
                cols += list(range(c, c + half)) + list(range(c + HEAD_DIM // 2,
                                                              c + HEAD_DIM // 2 + half))
        return torch.tensor(cols + list(range(len(cols), len(cols) + KV_HEADS * HEAD_DIM)))

    def qkv(self, m: int) -> torch.Tensor:
        """Matmul ``m`` (a q+k+v) as the model's ``[N, K]`` weight."""
        return self.weight(m)[torch.argsort(self.qkv_columns()).to(self.w.device)]

    def gate_up(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Matmul ``m`` (a gate+up) as its gate and up weights: unit ``t``'s rows are gate rows
        ``[t BN / 2, (t + 1) BN / 2)`` then the up rows of the same range."""
        w = self.weight(m).view(-1, 2, self.bn // 2, HIDDEN)
        return w[:, 0].reshape(-1, HIDDEN), w[:, 1].reshape(-1, HIDDEN)

    def _half(self, h: int) -> torch.Tensor:
        return self.act[h * ROWS * self.width:(h + 1) * ROWS * self.width].view(ROWS, self.width)

    def set_input(self, x: torch.Tensor) -> None:
        """``x [3, hidden]``: the embedded rows, the first residual."""
        self.act.zero_()
        self.resid.zero_()
        self.resid[:ROWS * HIDDEN].view(ROWS, HIDDEN).copy_(x)

    def output(self) -> torch.Tensor:
        return self._half(len(self.phases) % 2)[:, :VOCAB]

    def run(self, programs: int, stages: int, wait: bool = True, skip: int = 0,
            probe: torch.Tensor | None = None, look: int = 0, wrel: bool = False,
            mma: int = 0) -> None:
        """One step; ``skip`` (timing only, the output is not the step's) leaves out, by bit: 1
        the attention's work, 2 the norms, 8 the matmuls' math; ``probe`` (int64 ``[programs,
        phases, 3]``) takes each program's phase times; ``look``: the producer's L2 lookahead in
        bytes, a stress of the ring (``ws_chain._producer``, :data:`STRESS_LOOK`); ``wrel``: each
        consumer warp takes and hands back the ring's slots on its own (``ws_chain.take_slot``,
        ``give_slot``); ``mma`` 2: the matmul units on the tensor cores, the warps' partials
        added a group of units at a time (with ``wrel``, 16 x 512 tiles, 8 warps); 3 the same
        with a four-slot phase's B operands built once (``ws_chain.mma_b_operands``)."""
        if mma not in (0, 2, 3) or (mma and (not wrel or (self.bn, self.bk, self.warps)
                                             != (16, 512, 8))):
            raise ValueError(f"mma {mma}: 0, or 2 / 3 with the per-warp hand-over (wrel) on 16 x "
                             f"512 tiles and 8 warps (here {self.bn} x {self.bk}, {self.warps})")
        self.counter.zero_()
        launch_ring(_ws_step_kernel, (programs,), (
            self.descs[0], self.descs[1], self.tab, self.act, self.counter, self.err,
            self.resid, self.gammas, self.kc, self.vc, self.bt, self.cos, self.sin, self.part,
            self.ml, len(self.phases), self.width, self.eps, self.ctx, self.nsplit,
            self.span, HEAD_DIM ** -0.5, self.pages), dict(
            BN=self.bn, BK=self.bk, STAGES=stages,
            KSTEPS=max(KS) // self.bk, WAIT=wait, SPIN=SPIN_MAX, CH=self.ch,
            MS=triton.next_power_of_2(self.nsplit), NH=HEADS, NKV=KV_HEADS, HD=HEAD_DIM,
            PAGE=self.page, SKIP=skip, probe_ptr=self.err if probe is None else probe,
            PROBE=probe is not None, HID=HIDDEN, w_ptr=self.w, LOOK=look, MMA=mma,
            num_warps=self.warps), stages, self.warps, wrel)

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x [rows, heads, HD]`` at positions ``pos [rows]``, fp32 from bf16, rounded."""
        c, s = self.cos[pos].float()[:, None], self.sin[pos].float()[:, None]
        xf = x.float()
        rot = torch.cat([-xf[..., HEAD_DIM // 2:], xf[..., :HEAD_DIM // 2]], dim=-1)
        return (xf * c + rot * s).to(torch.bfloat16)

    def _norm(self, h: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        hf = h.float()
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (gamma.float() * normed.to(torch.bfloat16).float()).to(torch.bfloat16)

    def reference(self, x: torch.Tensor, caches: bool = False):
        """Torch, phase by phase, on a copy of the cache; returns the logits ``[3, vocab]`` (and,
        with ``caches``, the K and V caches it wrote)."""
        kc, vc = self.kc.clone(), self.vc.clone()
        pos = torch.arange(self.ctx, self.ctx + ROWS, device=x.device)
        allpos = torch.arange(self.ctx + ROWS, device=x.device)
        resid, prev, norms, m = x, torch.zeros_like(x), 0, 0

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (a.float() @ w.float().T).to(torch.bfloat16)

        for layer in range(self.layers):
            rows = (layer * self.pages + self.bt.long()[allpos // self.page]) * self.page \
                + allpos % self.page
            h = (resid.float() + prev.float()).to(torch.bfloat16)
            qkv = mm(self._norm(h, self.gammas[norms]), self.qkv(m))
            q = self._rotate(qkv[:, :HIDDEN].view(ROWS, HEADS, HEAD_DIM), pos)
            k = self._rotate(qkv[:, HIDDEN:HIDDEN + KV_HEADS * HEAD_DIM]
                             .view(ROWS, KV_HEADS, HEAD_DIM), pos)
            v = qkv[:, HIDDEN + KV_HEADS * HEAD_DIM:].view(ROWS, KV_HEADS, HEAD_DIM)
            kc[rows[self.ctx:]] = k
            vc[rows[self.ctx:]] = v
            keys = kc[rows].float().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [P, H, D]
            vals = vc[rows].float().repeat_interleave(HEADS // KV_HEADS, dim=1)
            sc = torch.einsum("thd,phd->htp", q.float(), keys) * HEAD_DIM ** -0.5
            sc = sc.masked_fill(allpos[None, None, :] > pos[None, :, None], float("-inf"))
            att = torch.einsum("htp,phd->thd", sc.softmax(-1), vals).to(torch.bfloat16)
            o = mm(att.reshape(ROWS, HIDDEN), self.weight(m + 1))
            resid = (h.float() + o.float()).to(torch.bfloat16)
            gate_w, up_w = self.gate_up(m + 2)
            a = self._norm(resid, self.gammas[norms + 1])
            gate, up = mm(a, gate_w), mm(a, up_w)
            act = (torch.nn.functional.silu(gate.float()).to(torch.bfloat16).float()
                   * up.float()).to(torch.bfloat16)
            prev = mm(act, self.weight(m + 3))
            norms, m = norms + 2, m + 4
        final = (resid.float() + prev.float()).to(torch.bfloat16)
        logits = mm(self._norm(final, self.gammas[norms]), self.weight(m))
        return (logits, kc, vc) if caches else logits


def phase_profile(step: WsStep, probe: torch.Tensor) -> dict:
    """From one probed step's times, per phase name, means over layers in us: ``share``, the
    time from the last program counting the previous phase to the last counting this one (the
    shares add up to the step); ``work_max`` / ``work_median``, the slowest / median program's
    time past its wait; ``wait_median``; ``lag``, the last program's count after the median
    program's; ``work_by_units``, the median work of the programs holding 1, 2, ... units; for
    q+k+v, ``work_q_only`` / ``work_with_kv``, of the programs whose units are all q units / hold
    a k or v unit (their epilogues write the cache)."""
    t = probe.double().cpu()
    ran = t[..., 2] > 0
    t0 = t[..., 0][ran].min()
    programs = t.shape[0]
    q_units = HEADS * (HEAD_DIM // 2) // (step.bn // 2)
    out, prev_end = {}, None
    for p, (name, *_) in enumerate(step.phases):
        r = ran[:, p]
        work = (t[:, p, 2] - t[:, p, 1]) / 1e3
        end = t[r, p, 2].max()
        share = end - (prev_end if prev_end is not None else t[r, p, 0].min())
        row = out.setdefault(name, dict(share=[], work_max=[], work_median=[], wait_median=[],
                                        lag=[], by_units={}, q_only=[], with_kv=[]))
        row["share"].append(share / 1e3)
        row["work_max"].append(work[r].max())
        row["work_median"].append(work[r].median())
        row["wait_median"].append((t[r, p, 1] - t[r, p, 0]).median() / 1e3)
        row["lag"].append((end - t[r, p, 2].median()) / 1e3)
        ustart, units = int(step.tab[p, 3]), int(step.tab[p, 9])
        held = [list(range((pid - ustart % programs + programs) % programs, units, programs))
                for pid in range(programs)]
        for n in sorted({len(h) for h in held} - {0}):
            sel = torch.tensor([len(h) == n for h in held])
            row["by_units"].setdefault(n, []).append(work[sel].median())
        if name == "qkv":
            kv = torch.tensor([any(u >= q_units for u in h) for h in held])
            row["q_only"].append(work[r & ~kv].median())
            row["with_kv"].append(work[r & kv].median())
        prev_end = end

    def mean(v: list) -> float:
        return round(float(sum(v)) / len(v), 2)

    res = {}
    for k, row in out.items():
        res[k] = {m: mean(row[m]) for m in ("share", "work_max", "work_median", "wait_median",
                                            "lag")}
        res[k]["work_by_units"] = {n: mean(v) for n, v in row["by_units"].items()}
        if row["q_only"]:
            res[k]["work_q_only"], res[k]["work_with_kv"] = mean(row["q_only"]), mean(row["with_kv"])
        res[k]["phases"] = len(row["share"])
    res["step_us"] = round(float(t[..., 2][ran].max() - t0) / 1e3, 1)
    return res


STRESS_LOOK = 128 * 1024
"""The producer's L2 lookahead that stresses the ring (``ws_chain._producer``): bytes a program."""


def distinct_outputs(step: WsStep, x: torch.Tensor, sms: int, stages: int, look: int,
                     steps: int, wrel: bool = False, mma: int = 0) -> list[torch.Tensor]:
    """The distinct logits of ``steps`` valid steps over ``x`` with the producer's lookahead
    ``look`` (one, for a step that is deterministic)."""
    outs: list[torch.Tensor] = []
    for _ in range(steps):
        step.set_input(x)
        step.run(sms, stages, look=look, wrel=wrel, mma=mma)
        got = step.output()
        if not any(torch.equal(got, o) for o in outs):
            outs.append(got.clone())
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--stages", type=int, nargs="+", default=[8])
    ap.add_argument("--splits", type=int, nargs="+", default=[16],
                    help="splits of the positions a KV head (attention units: 8 x splits)")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--ncu", action="store_true",
                    help="three valid steps (the first compiles), nothing timed or written: for "
                         "Nsight Compute")
    ap.add_argument("--probe", action="store_true",
                    help="one valid step with each program's phase times: each phase's share")
    ap.add_argument("--stress", type=int, default=0, metavar="N",
                    help="N valid steps plain and N under the ring's stress (the producer's L2 "
                         "lookahead, STRESS_LOOK): the distinct outputs of each")
    ap.add_argument("--skips", type=int, nargs="+", default=[0],
                    help="runs without the waits, leaving out by bit: 1 the attention's work, "
                         "2 the norms, 8 the matmuls' math (where the time goes; not a valid "
                         "step)")
    ap.add_argument("--hand-over", nargs="+", choices=("cta", "warp", "warp_mma", "warp_mma_b"),
                    default=["cta"],
                    help="how the consumers hand a ring slot back: all 8 warps at a barrier "
                         "(cta), or each warp on its own (warp: ws_chain.take_slot / give_slot; "
                         "warp_mma: the same with the matmuls on the tensor cores, the warps' "
                         "partials added a group of units at a time; warp_mma_b: with a "
                         "four-slot phase's B operands built once)")
    opts = ap.parse_args()
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if opts.ncu:
        step = WsStep(opts.layers, dev, splits=opts.splits[0], warps=opts.warps)
        step.set_input(torch.randn(ROWS, HIDDEN, device=dev).to(torch.bfloat16))
        for _ in range(3):
            step.run(sms, opts.stages[0])
        torch.cuda.synchronize()
        return
    report, emit = reporter("ws_step.json", rows=ROWS, layers=opts.layers, sms=sms)

    for c, splits in enumerate(opts.splits):
        step = WsStep(opts.layers, dev, splits=splits, warps=opts.warps)
        x = torch.randn(ROWS, HIDDEN, device=dev,
                        generator=torch.Generator(dev).manual_seed(1)).to(torch.bfloat16)
        want = step.reference(x)
        if c == 0:
            report["context"] = step.ctx
            report["weight_bytes"] = step.w.numel() * 2
            report["kv_bytes"] = step.kv_bytes()
            emit(dict(kind="read_weights", ms=read_ms(step.w, sms)))
        for stages, hand in itertools.product(opts.stages, opts.hand_over):
            wrel = hand != "cta"
            mma = {"warp_mma": 2, "warp_mma_b": 3}.get(hand, 0)
            runs = [("ws_step", True, 0)] + [("ws_step_free", False, k) for k in opts.skips]
            for kind, wait, skip in runs:
                step.set_input(x)
                step.err.zero_()
                step.run(sms, stages, wait, skip, wrel=wrel, mma=mma)
                torch.cuda.synchronize()
                row = dict(kind=kind, skip=skip, splits=splits, ch=step.ch, stages=stages,
                           warps=opts.warps, hand_over=hand,
                           programs=sms,
                           timed_out=bool(step.err.item()),
                           counts_ok=step.counter[:len(step.units)].tolist() == step.units)
                if wait:
                    got = step.output()
                    row["rel_err"] = rel_err(got, want)
                    row["argmax_agree"] = (got.float().argmax(-1)
                                           == want.float().argmax(-1)).tolist()
                    row["merges_ok"] = bool((step.counter[len(step.units):] == step.nsplit)
                                            .all().item())
                row["ms"] = graph_ms(lambda s=stages, wt=wait, k=skip, w=wrel, m=mma:
                                     step.run(sms, s, wt, k, wrel=w, mma=m))
                emit(row)
            if opts.probe:
                probe = torch.zeros(sms, len(step.phases), 3, dtype=torch.int64, device=dev)
                for _ in range(3):  # the last of three
                    probe.zero_()
                    step.run(sms, stages, True, 0, probe, wrel=wrel, mma=mma)
                torch.cuda.synchronize()
                emit(dict(kind="ws_step_probe", splits=splits, stages=stages, hand_over=hand,
                          phases=phase_profile(step, probe)))
            for look in ((0, STRESS_LOOK) if opts.stress else ()):
                outs = distinct_outputs(step, x, sms, stages, look, opts.stress, wrel, mma)
                emit(dict(kind="ws_step_repeats", splits=splits, stages=stages, hand_over=hand,
                          look=look,
                          steps=opts.stress, distinct=len(outs),
                          rel_errs=[rel_err(o, want) for o in outs]))
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
