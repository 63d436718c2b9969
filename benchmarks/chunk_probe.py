"""Probe: where the GDN chunk form's time goes (bs 64 all 8, Qwen3-Next shapes, graph replays).

Stage 1 runs the products over K alone (state and q/k slices through three-TF32 products),
stage 2 adds everything but the triangular solve, stage 3 is the whole chunk form; the row form
on the same inputs for reference. ``python benchmarks/chunk_probe.py`` -> chunk_probe.json.
"""
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from common import time_calls
from hybrid_kernels import _copies, _gdn_args, gdn_inputs
from ssd_kernels import SETTINGS, form_plan

from dspark_compile.kernels import gdn as triton_gdn

s = dict(SETTINGS)
rows = []
for bs in (64, 128):
    lens = [8] * bs
    floor = bs * 32 * 128 * 128 * 4
    sets = [gdn_inputs(lens, s, "cuda", seed=bs + i) for i in range(_copies(floor, s))]
    cases = [("rows", None, None, 3)] + [("chunk", b, w, st) for b in (32, 64, 128)
                                          for w in (1, 2, 4) for st in (1, 2, 3)]
    for form, block, warps, stage in cases:
        plan = form_plan("gdn", form, bs, s, "cuda", block, warps)
        triton_gdn._PROBE_STAGE = stage
        fns = [lambda c=c: triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s), plan=plan)
               for c in sets]
        try:
            t = time_calls(fns, s, "cuda")
        except Exception as e:  # noqa: BLE001 (a tile that does not compile)
            t = dict(error=str(e)[:200])
        rows.append(dict(bs=bs, form=form, block=block, warps=warps, stage=stage, **t,
                         floor_us=floor / 4.8e12 * 1e6))
        print(rows[-1], flush=True)
out = Path(os.environ.get("OUT") or ".")
(out / "chunk_probe.json").write_text(json.dumps(dict(
    gpu=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv),
    rows=rows), indent=1))
