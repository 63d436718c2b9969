"""The model zoo: every causal LM of the installed transformers, tiny and random, checked
against its own HF forward (``python -m dspark_compile zoo``).

* :mod:`.tiny`: a tiny config for any model type, by rules on field names.
* :mod:`.check`: one architecture: build, compile, prefill + three ragged verify/commit
  rounds, compare every verified row with HF; exact / refused / wrong / error / skipped.
* :mod:`.variants`: each model type again under config switches its checkpoints turn.
* :mod:`.runner`: checks in parallel processes with a time limit each.
* :mod:`.report`: the terminal table, JSON, ``docs/models.md`` and the README's list.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .check import STATUSES, TOLERANCE, Entry, Result, check, entries, tolerance
from .tiny import TinyConfig, tiny_config

__all__ = ["STATUSES", "TOLERANCE", "Entry", "Result", "TinyConfig", "check", "entries",
           "tiny_config", "select", "add_arguments", "main"]

PARTIAL_EVERY_S = 10.0
"""While checks run, the report is rewritten (marked ``partial``) at most this often: a run
stopped by a time limit keeps the rows it finished."""


def select(names: list[str] | None, skip_unknown: bool = False) -> list[Entry]:
    """The entries named (model type, ``type+variant`` or class name, any case); a model type
    brings its variants. All entries when ``names`` is empty; an unknown name raises
    ``ValueError`` listing the close ones, or with ``skip_unknown`` (a scripted list run
    against another transformers) is named in one log line and left out."""
    every = entries()
    if not names:
        return every
    chosen, unknown = [], []
    for name in names:
        key = name.lower()
        hits = [e for e in every if key in (e.name.lower(), e.model_type.lower(),
                                            e.architecture.lower())]
        if not hits:
            unknown.append(name)
        chosen += [e for e in hits if e not in chosen]
    if unknown:
        import difflib

        close = {n: difflib.get_close_matches(n.lower(), [e.name for e in every], n=3)
                 for n in unknown}
        what = "no such architecture in this transformers: " + "; ".join(
            f"{n} (close: {', '.join(c) or 'none'})" for n, c in close.items())
        if not skip_unknown:
            raise ValueError(what)
        print(f"zoo: left out, {what}", file=sys.stderr)
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``zoo`` subcommand's options."""
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="model types or class names (default: every *ForCausalLM and every "
                        "multimodal LM, verified on text)")
    parser.add_argument("--out", default="zoo.json", help="JSON report (default: zoo.json)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="checks in parallel, one process each (default: the CPU count)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one architecture may take (default 300)")
    parser.add_argument("--markdown", nargs="?", const="docs/models.md", metavar="FILE",
                        help="also write the Markdown table (default FILE: docs/models.md)")
    parser.add_argument("--update-readme", nargs="?", const="README.md", metavar="FILE",
                        help="rewrite the supported-models list between the zoo markers of "
                        "FILE (default README.md)")
    parser.add_argument("--from", dest="from_json", metavar="JSON",
                        help="write --markdown / --update-readme from a saved report, no run")
    parser.add_argument("--device", default="cpu",
                        help="where HF's forward and the verifier run (default cpu, the "
                        "reference lowering; cuda: the Triton lowering, exact within "
                        "zoo.check.GPU_TOLERANCE)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="verify dtype (bfloat16, float16: the float32 model cast, judged "
                        "against its float32 forward relative to HF's own error in that dtype)")
    parser.add_argument("--static", action="store_true",
                        help="verify through the tier session (Verifier.capture: static buffers "
                        "padded to each tier on the CPU, CUDA graphs on a GPU), so padded rows "
                        "and slots are checked to change nothing")
    parser.add_argument("--variants", action="store_true",
                        help="also check each selected model type under the config switches "
                        "of zoo/variants.py (biases, one KV head, scaled rotaries, windows, "
                        "softcaps, ...)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME",
                        help="with --variants, only these variants (repeatable, e.g. --variant "
                        "rope_yarn): the base checks and the other variants are left out")
    parser.add_argument("--combos", type=int, default=0, metavar="N",
                        help="also check N combinations of each selected model type's variants, "
                        "three switches at a time that set different fields (zoo/variants.py "
                        "combo_entries)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the combinations' draw (--combos): the same seed, the same ones")
    parser.add_argument("--skip-unknown", action="store_true",
                        help="leave out --only names this transformers lacks (one log line) "
                        "instead of refusing the run")
    parser.add_argument("--list", action="store_true", help="print the entries and exit")


def main(args: argparse.Namespace) -> int:
    """Run the zoo; exit status 1 when any architecture is ``wrong`` or ``error``."""
    from . import report as rep

    if args.list:
        for entry in _selected(args):
            print(f"{entry.name:32} {entry.architecture}")
        return 0
    if args.from_json:
        result = rep.load(args.from_json)
    else:
        result = _run(args, rep)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(rep.markdown(result))
        print(f"wrote {args.markdown}")
    if args.update_readme:
        link = os.path.relpath(os.path.abspath(args.markdown or "docs/models.md"),
                               os.path.dirname(os.path.abspath(args.update_readme)))
        rep.update_readme(args.update_readme, result, link)
        print(f"updated {args.update_readme}")
    bad = rep.counts(result["rows"])
    return 1 if bad["wrong"] or bad["error"] else 0


def _selected(args) -> list[Entry]:
    """The entries ``--only`` names, with their ``--variants``."""
    chosen = select(args.only, skip_unknown=getattr(args, "skip_unknown", False))
    wanted = getattr(args, "variant", None) or []
    if wanted and not getattr(args, "variants", False):
        raise ValueError(f"--variant {' '.join(wanted)} needs --variants")
    combos = getattr(args, "combos", 0)
    if combos < 0:
        raise ValueError(f"--combos {combos}: a count of combinations, 0 or more")
    base = chosen
    if getattr(args, "variants", False):
        from .variants import variant_entries

        chosen = variant_entries(chosen)
        if wanted:
            chosen = [e for e in chosen if e.variant in wanted]
    if combos:
        from .variants import combo_entries

        chosen += combo_entries(base, combos, getattr(args, "seed", 0))
    return chosen


def _run(args, rep) -> dict:
    from .runner import run_checks

    selected = _selected(args)
    start = time.perf_counter()
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        tqdm = None
    bar = tqdm(total=len(selected), unit="arch", file=sys.stderr, disable=None) \
        if tqdm else None  # disable=None: no bar when stderr is not a terminal
    write = bar.write if bar and not bar.disable else print

    head = {"environment": rep.environment(args.device), "jobs": args.jobs,
            "timeout": args.timeout, "only": args.only or [], "variants": bool(args.variants),
            "combos": getattr(args, "combos", 0), "seed": getattr(args, "seed", 0),
            "device": args.device, "dtype": args.dtype, "static": bool(args.static),
            "tolerance": tolerance(args.device)}
    done: list[dict] = []
    saved = [time.perf_counter()]

    def show(r: Result) -> None:
        err = "" if r.max_error is None else f"{r.max_error:.1e}"
        write(f"{r.name:32} {r.status:8} {err:9} {r.seconds:6.1f}s  "
              f"{' '.join(r.reason.split())[:160]}")
        if bar:
            bar.update(1)
        sys.stdout.flush()
        done.append(r.to_json())
        if time.perf_counter() - saved[0] > PARTIAL_EVERY_S:  # a stopped run keeps its rows
            rep.save(args.out, {**head, "partial": f"{len(done)} of {len(selected)} checks",
                                "rows": done})
            saved[0] = time.perf_counter()

    results = run_checks(selected, jobs=args.jobs, timeout=args.timeout, on_result=show,
                         device=args.device, dtype=args.dtype, static=args.static)
    if bar:
        bar.close()
    report = {**head, "wall_seconds": round(time.perf_counter() - start, 1),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "rows": [r.to_json() for r in results]}
    print()
    print(rep.table(report["rows"]))
    c = rep.counts(report["rows"])
    print(f"\n{', '.join(f'{c[s]} {s}' for s in STATUSES)} of {len(results)} "
          f"in {report['wall_seconds']:.0f} s ({args.jobs} jobs)")
    rep.save(args.out, report)
    print(f"wrote {args.out}")
    return report
