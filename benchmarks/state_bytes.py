"""Bytes of one verify state's pools per request slot, with and without ``window_rings``.

No GPU: the pools are allocated on the ``meta`` device by ``VerifierState.allocate`` itself
(the sizes are what a real state would hold), for layer specs at published model dims:

- ``dsv4_flash_like``: DeepSeek-V4's attention dims (one K=V head of 512, window 128,
  CSA every 4 tokens with overlap and a 128-channel indexer, HCA every 128), layers in the
  pattern sliding / HCA / CSA, 43 layers;
- ``gemma3_27b_like``: 62 layers, 5 sliding (window 1024) to 1 full, 16 KV heads of 128.

    python benchmarks/state_bytes.py [--context 65536 131072] [--step 4096 256]

Writes ``state_bytes.json`` to $OUT if set, else benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import os
import torch

from common import versions

from dspark_compile.specs import AttentionSpec, CompressSpec
from dspark_compile.state.pools import VerifierState


def dsv4_flash_like() -> list[AttentionSpec]:
    csa = CompressSpec(4, 512, True, 512, 64, 128)
    hca = CompressSpec(128, 512)
    kinds = [None, hca, csa] * 15
    return [AttentionSpec(1, 512, window=128, sinks=True, compress=c, shared_kv=True)
            for c in kinds[:43]]


def gemma3_27b_like() -> list[AttentionSpec]:
    return [AttentionSpec(16, 128, window=0 if (i + 1) % 6 == 0 else 1024)
            for i in range(62)]


MODELS = {"dsv4_flash_like": dsv4_flash_like, "gemma3_27b_like": gemma3_27b_like}


def state_bytes(specs, context: int, step: int | None) -> int:
    state = VerifierState.allocate(specs, 1, context, 64, torch.bfloat16,
                                   torch.device("meta"), step)
    pools = [t for pair in state.kv_caches for t in {id(x): x for x in pair}.values()]
    pools += state.compress_pools
    return sum(t.numel() * t.element_size() for t in pools)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--step", type=int, nargs="+", default=[4096, 256],
                    help="max_step_tokens of the ring states")
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = ap.parse_args(argv)
    rows = []
    for name, make in MODELS.items():
        specs = make()
        for context in args.context:
            full = state_bytes(specs, context, None)
            row = {"model": name, "context": context, "full_gib": full / 2**30}
            for step in args.step:
                ring = state_bytes(specs, context, step)
                row[f"rings_step{step}_gib"] = ring / 2**30
                row[f"full_over_rings_step{step}"] = full / ring
            rows.append(row)
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    data = {"environment": {**versions(gpu=False), "command": "benchmarks/state_bytes.py"},
            "settings": {"page_size": 64, "dtype": "bfloat16", "max_requests": 1,
                         "contexts": args.context, "steps": args.step},
            "measured": "bytes of every pool VerifierState.allocate makes for one slot, on "
                        "the meta device (K=V pools counted once)",
            "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "state_bytes.json"), "w") as f:
        json.dump(data, f, indent=1)
    return data


if __name__ == "__main__":
    main()
