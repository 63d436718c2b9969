"""Probe: where the GDN block form's time goes (GDN_PROBE 0 full, 1 no solve, 2 no Gram and no
solve, 3 main loop without the row mixing), graph replays, us, against the row form."""
import json, os, sys
import torch
from common import time_calls
from hybrid_kernels import _copies, _gdn_args, gdn_inputs
from ssd_kernels import SETTINGS, gdn_plan, lengths
from dspark_compile.kernels import gdn as triton_gdn
s = SETTINGS
rows = []
for bs in (64, 128):
    for mix in (True, False):
        lens = lengths(bs, mix, s)
        floor = bs * 32 * 128 * 128 * 4
        sets = [gdn_inputs(lens, s, "cuda", seed=bs + i) for i in range(_copies(floor, s))]
        for name, plan, probe in [("rows", gdn_plan("32,1,32,0,16", s), 0), ("block_gram_once", None, 0),
                                  ("block_gram_loop", None, 4), ("no_gram_no_solve", None, 2),
                                  ("gram_once_2w", gdn_plan("128,2,16,8,16", s), 0),
                                  ("gram_once_64", gdn_plan("64,1,16,8,16", s), 0),
                                  ("gram_once_kc32", gdn_plan("128,1,32,8,32", s), 0)]:
            os.environ["GDN_PROBE"] = str(probe)
            fns = [lambda c=c: triton_gdn.gated_delta_rule_triton(*_gdn_args(c, s), plan=plan) for c in sets]
            t = time_calls(fns, s, "cuda")
            rows.append(dict(bs=bs, mix=mix, form=name, probe=probe, **t,
                             floor_pct=round(100 * floor / 4.8e12 * 1e6 / min(t["eager_us"], t["graph_us"]), 1)))
            print(rows[-1], flush=True)
out = os.environ.get("OUT", ".")
json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), open(os.path.join(out, "gdn_probe.json"), "w"), indent=1)
