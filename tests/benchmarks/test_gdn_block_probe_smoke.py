"""benchmarks/gdn_block_probe.py on the CPU (Triton interpreter): every edit still finds its
anchor in gdn.py (else the probe would time an unedited copy under a variant's name), the
clocked copies build (every part's stamp in place), the ticket variant (roles from an atomic
counter, unbounded polling) gives the op's outputs bit for bit, and the late-rings variant the
op's outputs and rings."""

import re
import tempfile
from pathlib import Path

import torch

from helpers import load_benchmark


def test_variants_build_and_ticket_matches_op():
    probe = load_benchmark("gdn_block_probe")
    ssd = load_benchmark("ssd_kernels")
    tmp = tempfile.mkdtemp()
    # variant() exits naming an edit whose anchor is gone
    mods = {name: probe.variant(name, edits, tmp) for name, edits in probe.VARIANTS.items()}
    assert hasattr(probe.clocked(tmp), "_gdn_block_clocked")
    parts = probe.clocked(tmp, parts=True)  # exits naming a stamp whose anchor is gone
    calls = re.findall(r"^ +_stamp\(stamps_ptr,", Path(parts.__file__).read_text(), re.M)
    assert len(calls) == probe.STAMPS == 8
    s = dict(ssd.SMOKE, num_k_heads=2, num_v_heads=4, k_dim=16, v_dim=16)
    lens = [8, 5, 8]
    c = ssd.gdn_inputs(lens, s, "cpu", seed=4)
    plan = probe.triton_gdn.plan_gdn(len(lens), 4, 16, 16, 1, block_form=True)
    want = probe.triton_gdn.gated_delta_rule_triton(*ssd._gdn_args(c, s), plan=plan)
    got = mods["ticket"].gated_delta_rule_triton(*ssd._gdn_args(c, s), plan=plan)
    assert torch.equal(want, got)
    assert not want.isnan().any()
    # the ring keys after the flags: the same outputs and rings
    rings = [torch.full_like(r, 7.0) for r in c["rings"]]
    late = mods["late_rings"].gated_delta_rule_triton(
        *ssd._gdn_args(dict(c, rings=tuple(rings)), s), plan=plan)
    assert torch.equal(late, want)
    assert all(torch.equal(a, b) for a, b in zip(rings, c["rings"]))
