"""A/B probe: GDN verify forward variants side by side on one GPU (one-off; history keeps it).

Loads each variant module from a file (``ab/<name>.py``, a copy of ``kernels/gdn.py`` with a
change; ``current`` is the tree's own module) and runs ``ssd_kernels.gdn_case`` for every
variant at each batch size, lengths and ``BLOCK_V``, interleaved, so clocks and placement are
shared. Writes ``gdn_ab.json`` to ``$OUT``. Also records each compiled forward's registers and
spills as this triton builds them.

Usage: ``python benchmarks/gdn_ab.py --variants current base --bs 64 128 --blocks 16 32``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import hybrid_kernels  # noqa: E402
import ssd_kernels  # noqa: E402

from dspark_compile.kernels import gdn as current  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    if name == "current":
        return current
    spec = importlib.util.spec_from_file_location(f"dspark_compile.kernels._ab_{name}",
                                                  ROOT / "ab" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def regs(mod) -> list:
    out = []
    for kern in (mod._gdn_forward_kernel, mod._gdn_commit_kernel):
        try:
            for cache in kern.device_caches.values():
                for ck in cache[0].values():
                    out.append(dict(kernel=kern.fn.__name__, n_regs=ck.n_regs,
                                    n_spills=ck.n_spills,
                                    block_v=ck.src.constants.get("BLOCK_V") if hasattr(
                                        ck, "src") else None))
        except Exception as e:  # noqa: BLE001 - a probe: record what failed
            out.append(dict(kernel=kern.fn.__name__, error=repr(e)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=["base", "current"])
    ap.add_argument("--bs", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--blocks", type=int, nargs="+", default=[32])
    ap.add_argument("--mix", nargs="+", default=["all8", "mix"])
    ap.add_argument("--rounds", type=int, default=1)
    opts = ap.parse_args()
    s = ssd_kernels.SETTINGS
    mods = {v: load(v) for v in opts.variants}
    import triton
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, command=" ".join(sys.argv), settings=s, rows=[])
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results") / "gdn_ab.json"
    kpad = 1 << (s["k_dim"] - 1).bit_length()
    for rnd in range(opts.rounds):
        for bs in opts.bs:
            for mix in opts.mix:
                for bv in opts.blocks:
                    for name, mod in mods.items():
                        ssd_kernels.triton_gdn = hybrid_kernels.triton_gdn = mod
                        plan = mod.GdnPlan(kpad, bv, -(-s["v_dim"] // bv))
                        r = ssd_kernels.gdn_case(bs, mix == "mix", s, "cuda", plan)
                        row = dict(round=rnd, variant=name, bs=bs, lengths=mix, block_v=bv,
                                   graph_us=r["graph_us"], eager_us=r["eager_us"],
                                   floor_pct=r["floor_pct"], err=r["max_abs_err"],
                                   commit_us=r["commit"]["best_us"],
                                   commit_pct=r["commit"]["floor_pct"])
                        report["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        out.write_text(json.dumps(report, indent=1))
    report["registers"] = {name: regs(mod) for name, mod in mods.items()}
    print(json.dumps(report["registers"]), flush=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
