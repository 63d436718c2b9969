"""Command line: ``python -m dspark_compile demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark_compile")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a tiny HF Llama and run verify steps")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo, run_engine_demo

        worst = run_demo(seed=args.seed)
        lossless = run_engine_demo(seed=args.seed)
        return 0 if worst < 1e-4 and lossless else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
