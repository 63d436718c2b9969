"""Drafted special tokens: is a verify step whose drafts hold the config's special ids (image,
video and audio placeholders, BOS/EOS/pad, ...) the target's own forward on them?

A draft may propose any id of the vocabulary. For every model type the zoo verifies exact
(``benchmarks/results/zoo.json`` by default), the tiny model is compiled, a prompt of ordinary
ids is prefilled, and one verify step of 16 drafted ids, every other one a special id of the
config, is compared with HF's forward over the same ids (float32, CPU, reference lowering),
through the zoo's runner (a process a check, a time limit). A row is ``exact`` within 1e-4,
else ``wrong``; ``skipped`` where the config names no special id inside the vocabulary or HF's
own forward refuses the ids.

    python benchmarks/drafted_special_tokens.py [--zoo JSON] [--jobs N] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dspark_compile.zoo.check import Entry, Result

TOLERANCE = 1e-4
DRAFT = 16


def check_special(entry: Entry, phase=lambda _: None, device: str = "cpu",
                  dtype: str = "float32", static: bool = False) -> Result:
    """The row of ``entry`` (``run_checks``' ``check_fn``; CPU, float32, no tiers only)."""
    start = time.perf_counter()
    result = Result(entry.name, entry.model_type, entry.architecture, "skipped")
    try:
        _run(entry, result)
    except Exception as err:  # noqa: BLE001 - a row, not a crash of the run
        result.status, result.reason = "error", f"{type(err).__name__}: {str(err)[:200]}"
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def _run(entry: Entry, result: Result) -> None:
    import transformers as T

    from dspark_compile import VerifyLayout, dspark_compile
    from dspark_compile.frontend.own_forward import config_token_ids
    from dspark_compile.zoo.tiny import tiny_config

    cls = getattr(T, entry.architecture)
    tiny = tiny_config(entry.model_type, cls)
    torch.manual_seed(0)
    model = cls._from_config(tiny.config, attn_implementation="eager",
                             dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().num_embeddings
    special = sorted(i for i in config_token_ids(tiny.config.to_dict()) if 0 <= i < vocab)
    if not special:
        result.reason = "no special id inside the vocabulary"
        return
    allowed = torch.tensor(sorted(set(range(vocab)) - set(special)))
    gen = torch.Generator().manual_seed(1)

    def ordinary(n):
        return allowed[torch.randint(0, allowed.numel(), (n,), generator=gen)]

    prompt = ordinary(6)
    draft = torch.stack([x for s in special for x in (ordinary(1)[0], torch.tensor(s))])
    draft = draft.repeat(DRAFT // draft.numel() + 1)[:DRAFT]
    try:
        with torch.no_grad():
            want = model(input_ids=torch.cat([prompt, draft])[None]).logits[0, -DRAFT:]
    except Exception as err:  # noqa: BLE001 - HF's own forward refuses these ids
        result.reason = f"HF forward: {type(err).__name__}: {str(err)[:120]}"
        return
    verifier = dspark_compile(model)
    state = verifier.new_state(max_requests=1, max_context=64)
    extra = {} if verifier.adapter.mrope is None else {"mrope_deltas": [0]}
    layout = VerifyLayout.pack([6], [0], [0], **extra)
    verifier(prompt, layout, state)
    verifier.commit(layout, [6], state)
    got = verifier(draft, VerifyLayout.pack([DRAFT], [6], [0], **extra), state)
    result.max_error = (got.float() - want).abs().max().item()
    result.status = "exact" if result.max_error <= TOLERANCE else "wrong"
    result.reason = f"special ids {special}"


def main() -> int:
    from dspark_compile.zoo import report
    from dspark_compile.zoo.runner import run_checks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", default="benchmarks/results/zoo.json")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--out", default="benchmarks/results/drafted_special_tokens_cpu.json")
    args = parser.parse_args()
    with open(args.zoo) as f:
        zoo = json.load(f)
    entries = [Entry(r["model_type"], r["architecture"]) for r in zoo["rows"]
               if r["status"] == "exact" and r["name"] == r["model_type"]]

    def show(r: Result) -> None:
        err = "" if r.max_error is None else f"{r.max_error:.1e}"
        print(f"{r.name:28} {r.status:8} {err:9} {r.reason[:120]}", flush=True)

    rows = run_checks(entries, jobs=args.jobs, timeout=args.timeout, on_result=show,
                      check_fn=check_special)
    counts = report.counts([r.to_json() for r in rows])
    report.save(args.out, {"environment": report.environment("cpu"),
                           "command": " ".join(["python"] + sys.argv),
                           "zoo": zoo["environment"], "tolerance": TOLERANCE,
                           "counts": counts, "rows": [r.to_json() for r in rows]})
    print(counts)
    return 1 if counts["wrong"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
