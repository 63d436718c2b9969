"""Probe (issue 25): where the Mamba-2 block form's time goes, at Nemotron-H's shapes.

A stripped copy of the block form's state stream, one program a (request, head, channel
block), timed beside the library's row walk and block form on the same inputs (graph replays,
us, all 8 rows):
- ``stream``: ``out = C S0`` only (the state read once through float32 FMA dots);
- ``stream+gram``: plus the Gram ``C B^T`` in the same loop, folded into the output;
- each at channel blocks 32 / 64, one or two warps, and software-pipelining depths 1-4.

The probe kernels compute no recurrence: they bound what the block form can reach, they are
not an op. Usage: ``python benchmarks/ssd_block_probe.py [BS ...]`` (an H200; default 64 128);
writes ``ssd_block_probe.json`` to ``$OUT`` or ``benchmarks/results/``."""
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import time_calls, versions, write_json
from hybrid_kernels import _copies
from ssd_kernels import SETTINGS, _rates, _ssd_args, ssd_inputs, ssd_plan

from dspark_compile.kernels import ssd as triton_ssd


@triton.jit
def _stream_kernel(out_ptr, c_ptr, b_ptr, state_ptr, qsl_ptr, slots_ptr, stride_c_tok,
                   stride_c_group, stride_out_tok, stride_out_head, stride_s_slot,
                   stride_s_head, stride_s_n, H: tl.constexpr, G: tl.constexpr,
                   NS: tl.constexpr, P: tl.constexpr, N_PAD: tl.constexpr,
                   BLOCK_P: tl.constexpr, NUM_PB: tl.constexpr, T: tl.constexpr,
                   BLOCK_N: tl.constexpr, GRAM: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1) // NUM_PB
    pb = tl.program_id(1) % NUM_PB
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    if length <= 0:
        return
    slot = tl.load(slots_ptr + req).to(tl.int64)
    group = head // (H // G)
    offs_t = tl.arange(0, T)
    in_req = offs_t < length
    rows = start.to(tl.int64) + offs_t
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    offs_c = tl.arange(0, BLOCK_N)
    s_base = state_ptr + slot * stride_s_slot + head * stride_s_head
    acc = tl.zeros([T, BLOCK_P], tl.float32)
    cb = tl.zeros([T, T], tl.float32)
    for n0 in range(0, N_PAD, BLOCK_N):
        nn = n0 + offs_c
        n_ok = nn < NS
        rn_ok = in_req[:, None] & n_ok[None, :]
        c = tl.load(c_ptr + rows[:, None] * stride_c_tok + group * stride_c_group + nn[None, :],
                    mask=rn_ok, other=0.0).to(tl.float32)
        s0 = tl.load(s_base + nn[:, None] * stride_s_n + offs_p[None, :],
                     mask=n_ok[:, None] & p_ok[None, :], other=0.0)
        acc = tl.dot(c, s0, acc, input_precision="ieee")
        if GRAM:
            b = tl.load(b_ptr + rows[:, None] * stride_c_tok + group * stride_c_group
                        + nn[None, :], mask=rn_ok, other=0.0).to(tl.float32)
            cb = tl.dot(c, tl.trans(b), cb, input_precision="ieee")
    if GRAM:
        acc = acc + tl.sum(cb, 1)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out_tok + head * stride_out_head + offs_p[None, :],
             acc, mask=in_req[:, None] & p_ok[None, :])


def stream(c, s, block_p=64, warps=1, stages=3, gram=False):
    h, ns, p, g = s["ssd_heads"], s["ssd_state"], s["ssd_head_dim"], s["ssd_groups"]
    r = c["qsl"].shape[0] - 1
    out = c.setdefault("probe_out", torch.empty(c["x"].shape, device=c["x"].device))
    nb = triton.cdiv(p, block_p)
    st = c["state"]
    _stream_kernel[(r, h * nb)](out, c["C"], c["B"], st, c["qsl"], c["slots"], c["C"].stride(0),
                               c["C"].stride(1), out.stride(0), out.stride(1), st.stride(0),
                               st.stride(1), st.stride(2), H=h, G=g, NS=ns, P=p,
                               N_PAD=triton.next_power_of_2(ns), BLOCK_P=block_p, NUM_PB=nb,
                               T=8, BLOCK_N=16, GRAM=gram, num_warps=warps, num_stages=stages)
    return out


def check_stream(got, c, s):
    """Max abs error of the stream's ``C S0`` against torch, over the first four requests."""
    h, g = s["ssd_heads"], s["ssd_groups"]
    grp = torch.arange(h, device=got.device) // (h // g)
    qsl, slots = c["qsl"].tolist(), c["slots"].long()
    err = 0.0
    for i in range(min(4, len(qsl) - 1)):
        a, b = qsl[i], qsl[i + 1]
        want = torch.einsum("thn,hnp->thp", c["C"][a:b].float()[:, grp],
                            c["state"][slots[i]].float())
        err = max(err, (got[a:b] - want).abs().max().item())
    return err


def main():
    s = SETTINGS
    out = os.environ.get("OUT") or str(Path(__file__).parent / "results")
    rows = []
    for bs in [int(a) for a in sys.argv[1:]] or (64, 128):
        lens = [8] * bs
        h, ns, p = s["ssd_heads"], s["ssd_state"], s["ssd_head_dim"]
        floor = bs * h * ns * p * 4
        sets = [ssd_inputs(lens, s, "cuda", seed=bs + i) for i in range(_copies(floor, s))]
        c0 = sets[0]
        cases = [(spec, None) for spec in ("rows", "block:bp64")]
        for bp, w in ((64, 1), (32, 1), (64, 2)):
            for stages in (1, 2, 3, 4):
                cases.append((f"stream p{bp} w{w} stages{stages}",
                              dict(block_p=bp, warps=w, stages=stages)))
        cases += [("stream+gram p64 w1 stages3", dict(gram=True)),
                  ("stream+gram p32 w1 stages3", dict(gram=True, block_p=32))]
        for name, kw in cases:
            if kw is None:
                plan = ssd_plan(name, bs, s, "cuda")
                fns = [lambda c=c, plan=plan: triton_ssd.ssd_triton(*_ssd_args(c), plan=plan)
                       for c in sets]
            else:
                if not kw.get("gram"):  # the stream against C S0 of each request's slot
                    err = check_stream(stream(c0, s, **kw), c0, s)
                    if err > 1e-2:
                        raise AssertionError(f"{name}: max abs error {err}")
                fns = [lambda c=c, kw=kw: stream(c, s, **kw) for c in sets]
            rows.append(dict(bs=bs, lengths="all8", case=name,
                             **_rates(floor, time_calls(fns, s, "cuda"), s)))
            print(rows[-1], flush=True)
            report = dict(versions(), command=" ".join(sys.argv), rows=rows)
            write_json(out, "ssd_block_probe.json", report)


if __name__ == "__main__":
    main()
