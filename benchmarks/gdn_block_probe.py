"""Probe: where the GDN block form's time goes (bs 64 / 128, all 8 rows, Qwen3-Next's shapes).

Times edited copies of ``dspark_compile/kernels/gdn.py``'s block form side by side (CUDA-graph
replays over rotating input copies, ``common.time_calls``):

- ``op``: the kernel as it is;
- ``stream_only``: weight programs exit at once, stream programs take the scratch as weights
  without reading a flag (no weight arithmetic anywhere: the state stream and the mix alone);
- ``weights_only``: stream programs exit at once (the weight programs alone);
- ``no_flag``: both kinds run in full, stream programs take the scratch without a flag (the
  weight programs' share of slots, without the hand-over);
- ``flag_only``: as ``no_flag`` with the flag's first read (an acquire) kept;
- ``no_own``: the op without the path where a stream program makes its own weights;
- ``ticket``: ``no_own`` with each program's role from a ticket (an atomic counter) instead of
  its grid index, and unbounded polling: weight tickets come first, so a polling stream
  program's weight program is already running (a look-back scan's progress argument);
- ``late_rings``: the weight program stores its ring keys after its flags, so no release waits
  for those stores (the op's outputs and rings);
- ``clocks``: the op with each program's start and end (``%globaltimer``, ``%clock64``) and
  multiprocessor recorded, one launch: durations by kind, and when the weight programs end;
- ``parts``: the same with stamps at the ends of each program's parts (:data:`PARTS`), the
  median cycles of each part by kind.

Outputs of the edited copies are not checked (they compute garbage on purpose); ``op`` is the
op itself. Writes ``gdn_block_probe.json`` to ``$OUT`` (else ``benchmarks/results/``).
Usage: ``python benchmarks/gdn_block_probe.py [64 128] [--variants op parts ...]`` (all of them
by default).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
from common import time_calls
from hybrid_kernels import _copies, _gdn_args, gdn_inputs
from ssd_kernels import SETTINGS

from dspark_compile.kernels import gdn as triton_gdn

SRC = Path(triton_gdn.__file__).read_text()
SRC = SRC.replace("from .launch import", "from dspark_compile.kernels.launch import") \
    .replace("from ..ops.", "from dspark_compile.ops.") \
    .replace("from .device import", "from dspark_compile.kernels.device import") \
    .replace("from .pdl import", "from dspark_compile.kernels.pdl import")

NO_WEIGHTS = ("    if (length > 0) & (length <= T):\n        # the first value head's",
              "    if length < 0:\n        # the first value head's")
# a flag of at least 1 read at run time (a constant 1 would let the compiler drop the stream's
# products: kept = 0 makes every row's output NaN whatever they are)
NO_FLAG = ('    ready = tl.atomic_add(ready_ptr + unit, 0, sem="acquire", scope="gpu")',
           "    ready = tl.maximum(tl.load(ready_ptr + unit), 1)")
NO_STREAMS = ("    req = b % (num_requests + 1)\n", "    if b >= 0:\n        return\n"
              "    req = b % (num_requests + 1)\n")
CLOCKS_KERNEL = '''

@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _cycles():
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _stamp(stamps_ptr, i, dep):
    """%clock64 once ``dep`` (a scalar) is ready, into this program's slot ``i`` of 8."""
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep.to(tl.int32)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    tl.store(stamps_ptr + tl.program_id(0).to(tl.int64) * 8 + i, c)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _gdn_block_clocked(times_ptr, *args):
    pass
'''
FLAG_ONLY = ('    tl.debug_barrier()  # the acquire for every thread\'s loads below\n',
             '    ready = tl.maximum(ready, 1)\n    tl.debug_barrier()\n')
NO_OWN = ("""        else:  # the weight program has not finished: the same arithmetic here
            gkk, gqk, nk, nq = _block_gram(""", """        else:
            kept = ready - 1
        if False:
            gkk, gqk, nk, nq = _block_gram(""")
TICKET = [("    pid = tl.program_id(0)\n",
           '    pid = tl.atomic_add(ready_ptr + num_requests * HV, 1, sem="relaxed", scope="gpu")\n'),
          ("ready = torch.zeros(max(r * hv, 1), dtype", "ready = torch.zeros(r * hv + 1, dtype"),
          ("while (ready == 0) & (polls < POLLS):", "while ready == 0:")]
RING_KEYS = ("        _ring_keys(k_ptr, ring_k_ptr, start, length, k_head, nk, stride_k_tok,"
             " stride_k_head,\n                   HK, KD, K_PAD, T, L2NORM)\n")
RELEASE = '            tl.atomic_xchg(ready_ptr + unit, kept + 1, sem="release", scope="gpu")\n'
# the ring keys after the flags: no release waits for their stores (the same outputs and rings)
LATE_RINGS = [(RING_KEYS, ""), (RELEASE, RELEASE + RING_KEYS)]
VARIANTS = {"stream_only": [NO_WEIGHTS, NO_FLAG], "weights_only": [NO_STREAMS],
            "no_flag": [NO_FLAG], "flag_only": [FLAG_ONLY], "no_own": [NO_OWN],
            "ticket": [NO_OWN, *TICKET], "late_rings": LATE_RINGS}


def variant(name: str, edits: list, tmp: str):
    src = SRC
    for old, new in edits:
        if old not in src:
            raise SystemExit(f"probe {name}: the edit's anchor is gone from gdn.py: {old!r}")
        src = src.replace(old, new)
    path = Path(tmp) / f"gdn_probe_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"gdn_probe_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# stamps inside the body (``parts``): a weight program's after its Gram products (1), its ring
# keys (2), and for value head j its weights (3 + 2j) and its flag's release (4 + 2j); a stream
# program's after its slot (1), its first flag read (2), its stream (3), its polls or own
# weights (4). Each waits for a value of the part it closes (a reduction of it: a few hundred
# cycles the op does not spend).
PARTS = [
    # the weight program (a helper): stamps_ptr passed down to it (the weights-launch kernel,
    # never launched here, passes 0)
    ("def _weight_program(a, q_ptr,", "def _weight_program(stamps_ptr, a, q_ptr,"),
    ("            _weight_program(a, q_ptr,", "            _weight_program(stamps_ptr, a, q_ptr,"),
    ("    _weight_program(tl.program_id(0), q_ptr,", "    _weight_program(0, tl.program_id(0), q_ptr,"),
    ("        _ring_keys(k_ptr, ring_k_ptr,",
     "        _stamp(stamps_ptr, 1, tl.sum(gkk) + tl.sum(gqk) + tl.sum(nq))\n"
     "        _ring_keys(k_ptr, ring_k_ptr,"),
    ("        for j in tl.static_range(HV // HK):\n",
     "        _stamp(stamps_ptr, 2, length)\n        for j in tl.static_range(HV // HK):\n"),
    ("            unit = (req * HV + head).to(tl.int64)\n            tile",
     "            _stamp(stamps_ptr, 3 + 2 * j, tl.sum(w) + tl.sum(c) + kept)\n"
     "            unit = (req * HV + head).to(tl.int64)\n            tile"),
    ('            tl.atomic_xchg(ready_ptr + unit, kept + 1, sem="release", scope="gpu")\n',
     '            old = tl.atomic_xchg(ready_ptr + unit, kept + 1, sem="release",'
     ' scope="gpu")\n            _stamp(stamps_ptr, 4 + 2 * j, old)\n'),
    # the stream program
    ("    if length > T:\n        for sub",
     "    _stamp(stamps_ptr, 1, slot + length)\n    if length > T:\n        for sub"),
    ("    acc = tl.zeros([2 * T, BLOCK_V], f32)\n    offs_sc",
     "    _stamp(stamps_ptr, 2, ready)\n    acc = tl.zeros([2 * T, BLOCK_V], f32)\n    offs_sc"),
    ("    # the values (raw) into the replay ring",
     "    _stamp(stamps_ptr, 3, tl.sum(acc))\n    # the values (raw) into the replay ring"),
    ("    # rows from the first unusable one on",
     "    _stamp(stamps_ptr, 4, tl.sum(w) + kept)\n    # rows from the first unusable one on"),
]
STAMPS = sum(new.count("_stamp(stamps_ptr,") for _, new in PARTS)
WEIGHT_PARTS = ["Gram", "ring keys", "head 0 weights", "head 0 release", "head 1 weights",
                "head 1 release", "exit"]
STREAM_PARTS = ["span and slot", "first flag read", "stream", "polls or own weights",
                "mix and store"]


def clocked(tmp: str, parts: bool = False):
    """The op's kernel with a timestamp record a program: the body runs as an inlined
    function, the record after it (every early return ends the body, not the program); with
    ``parts`` the body also stamps the ends of its parts (:data:`PARTS`)."""
    body = SRC
    if parts:
        for old, new in PARTS:
            if old not in body:
                raise SystemExit(f"probe parts: the stamp's anchor is gone from gdn.py: {old!r}")
            body = body.replace(old, new)
    src = body.replace("def _gdn_block_kernel(\n        out_ptr,",
                       "def _gdn_block_body(\n        stamps_ptr, out_ptr,")
    sig = SRC[SRC.index("def _gdn_block_kernel(") + len("def _gdn_block_kernel("):]
    sig = sig[:sig.index("):")]
    params = [p.split(":")[0].strip() for p in sig.replace("\n", " ").split(",") if p.strip()]
    params = ["times_ptr + tl.num_programs(0).to(tl.int64) * 5", *params]
    src += CLOCKS_KERNEL.replace(
        "def _gdn_block_clocked(times_ptr, *args):\n    pass",
        f"def _gdn_block_clocked(times_ptr, {sig}):\n"
        "    t0 = _now()\n    c0 = _cycles()\n"
        f"    _gdn_block_body({', '.join(params)})\n"
        "    c1 = _cycles()\n    t1 = _now()\n"
        "    base = times_ptr + tl.program_id(0).to(tl.int64) * 5\n"
        "    tl.store(base, t0)\n    tl.store(base + 1, t1)\n    tl.store(base + 2, c0)\n"
        "    tl.store(base + 3, c1)\n    tl.store(base + 4, _smid().to(tl.int64))")
    anchor = "    launch(_gdn_block_kernel, ((0 if split else r * hk) + (r + 1) * hv * num_vb,),\n"
    if anchor + "           out," not in src:
        raise SystemExit(f"probe clocks: the launch's anchor is gone from gdn.py: {anchor!r}")
    src = src.replace(anchor + "           out,",
                      anchor.replace("_gdn_block_kernel", "_gdn_block_clocked")
                      + "           TIMES[0], out,")
    src += "\nTIMES = [None]\n"
    name = "gdn_probe_parts" if parts else "gdn_probe_clocks"
    path = Path(tmp) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def stats(x: torch.Tensor) -> dict:
    x = x.double()
    q = torch.quantile(x, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return dict(n=len(x), mean=round(x.mean().item(), 2), p10=round(q[0].item(), 2),
                p50=round(q[1].item(), 2), p90=round(q[2].item(), 2),
                max=round(x.max().item(), 2))


def timeline(clk, programs: int, units: int, c: dict, s: dict) -> dict:
    """One launch of a clocked build: each kind's cycles, start and end (us from the first
    program's start), and for the ``parts`` build each part's cycles."""
    clk.TIMES[0] = torch.zeros(programs * 13, dtype=torch.int64, device="cuda")
    for _ in range(2):
        clk.gated_delta_rule_triton(*_gdn_args(c, s))
    torch.cuda.synchronize()
    t = clk.TIMES[0][: programs * 5].view(programs, 5).cpu()
    marks = clk.TIMES[0][programs * 5:].view(programs, 8).cpu()
    start = t[:, 0].min()
    rel_end = (t[:, 1] - start).double() / 1e3
    rel_start = (t[:, 0] - start).double() / 1e3
    cyc = (t[:, 3] - t[:, 2]).double()
    w, st = slice(0, units), slice(units, programs)
    out = dict(launch_us=round(rel_end.max().item(), 2), weight_cycles=stats(cyc[w]),
               stream_cycles=stats(cyc[st]), weight_end_us=stats(rel_end[w]),
               weight_start_us=stats(rel_start[w]), stream_start_us=stats(rel_start[st]),
               stream_end_us=stats(rel_end[st]), sms=int(t[:, 4].max().item()) + 1)
    if bool((marks != 0).any()):
        for kind, rows, names in (("weight", w, WEIGHT_PARTS), ("stream", st, STREAM_PARTS)):
            m = marks[rows]
            n = len(names) - 1  # stamps 1..n, then the end
            edges = torch.cat([t[rows, 2:3], m[:, 1:n + 1], t[rows, 3:4]], 1)
            # programs that took another path (long requests, the padding row) stamp less
            full = (m[:, 1:n + 1] != 0).all(1)
            steps = (edges[full, 1:] - edges[full, :-1]).double()
            out[f"{kind}_parts_cycles_p50"] = {
                name: round(torch.quantile(steps[:, i], 0.5).item(), 1)
                for i, name in enumerate(names)} if full.any() else {}
            out[f"{kind}_parts_programs"] = int(full.sum().item())
    return out


def main() -> None:
    s = dict(SETTINGS)
    device = "cuda"
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    tmp = tempfile.mkdtemp()
    names = ["op", *VARIANTS, "clocks", "parts"]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", nargs="+", choices=names, default=names)
    ap.add_argument("bs", nargs="*", type=int, default=[64, 128])
    opts = ap.parse_args()
    mods = {"op": triton_gdn, **{n: variant(n, e, tmp) for n, e in VARIANTS.items()}}
    mods = {n: m for n, m in mods.items() if n in opts.variants}
    clocks = {n: clocked(tmp, parts=n == "parts") for n in ("clocks", "parts")
              if n in opts.variants}
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, settings=s, variants=opts.variants, rows=[])
    for bs in opts.bs:
        lens = [s["block"]] * bs
        hv, kd, vd = s["num_v_heads"], s["k_dim"], s["v_dim"]
        floor = bs * hv * kd * vd * 4
        sets = [gdn_inputs(lens, s, device, seed=bs + i) for i in range(_copies(floor, s))]
        for name, mod in mods.items():
            fns = [lambda c=c, m=mod: m.gated_delta_rule_triton(*_gdn_args(c, s)) for c in sets]
            t = time_calls(fns, s, device)
            row = dict(bs=bs, variant=name, **t,
                       floor_pct=round(100 * floor / 4.8e12 * 1e6 / t["graph_us"], 1))
            report["rows"].append(row)
            print(row, flush=True)
        # the ticket and late-rings variants compute the op's outputs: the same bits
        want = triton_gdn.gated_delta_rule_triton(*_gdn_args(sets[0], s))
        for name in ("ticket", "late_rings"):
            if name not in mods:
                continue
            got = mods[name].gated_delta_rule_triton(*_gdn_args(sets[0], s))
            report["rows"].append(dict(bs=bs, variant=f"{name}_equals_op",
                                       equal=bool(torch.equal(want, got))))
            print(report["rows"][-1], flush=True)
        # one clocked launch of each build (after a warm one), on the first copy
        r, hk = bs, s["num_k_heads"]
        programs = r * hk + (r + 1) * hv * triton.cdiv(vd, 64)
        for label, clk in clocks.items():
            row = dict(bs=bs, variant=label, **timeline(clk, programs, r * hk, sets[0], s))
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gdn_block_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
