"""Where a tier-graph verify step's time goes: full call vs graph replay alone vs host work.

Same model and settings as verify_step.py. For bs 1 and 256 (mean-3 mix) it times a full
``verifier(ids, layout, state)`` call, ``graphs[tier].replay()`` alone, and the host-side
``check_layout`` and ``fill`` per call.

    python benchmarks/replay_overhead.py
"""

from __future__ import annotations

import time

import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.graphs.tiers import Tier
from verify_step import BLOCK, CONTEXT, PAGE, build_model, mix_lens, time_ms


def host_ms(fn, iters: int = 200) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    model = build_model()
    verifier = dspark_compile(model, lowering="triton", inductor=True, page_size=PAGE,
                              block=BLOCK)
    state = verifier.new_state(max_requests=256, max_context=CONTEXT + BLOCK)
    state.committed_lens[:] = CONTEXT
    tiers = {1: Tier(3, 1), 256: Tier(768, 256)}
    verifier.capture(state, tiers=tuple(tiers.values()), progress=False)
    graphs = state.graphs
    for bs, tier in tiers.items():
        layout = VerifyLayout.pack(mix_lens(bs), [CONTEXT] * bs, list(range(bs)))
        ids = torch.randint(0, 32000, (layout.num_tokens,), device="cuda")
        full = time_ms(lambda: verifier(ids, layout, state), 50)
        replay = time_ms(graphs.graphs[tier].replay, 50)
        check = host_ms(lambda: state.check_layout(layout, layout.num_tokens))
        fill = host_ms(lambda: graphs.fill(tier, ids, layout))
        print(f"bs {bs}: full call {full:.3f} ms, replay only {replay:.3f} ms, "
              f"check_layout {check:.3f} ms, fill {fill:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
