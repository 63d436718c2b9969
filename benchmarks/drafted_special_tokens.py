"""Drafted special tokens: is a verify step whose drafts hold the config's special ids (image,
video and audio placeholders, BOS/EOS/pad, ...) the target's own forward on them?

A draft may propose any id of the vocabulary. For every model type the zoo verifies exact
(``benchmarks/results/zoo.json`` by default), the tiny model is compiled, a prompt of ordinary
ids is prefilled, and one verify step of 16 drafted ids, every other one a special id of the
config, is compared with HF's forward over the same ids (float32, CPU, reference lowering).
A row is ``ok`` within 1e-4, else ``wrong``; ``hf-fails`` where HF's own forward refuses the ids,
``no-special`` where the config names none inside the vocabulary.

    python benchmarks/drafted_special_tokens.py [--zoo JSON] [--jobs N] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

import torch

TOLERANCE = 1e-4
DRAFT = 16


def check(model_type: str, architecture: str) -> tuple[str, str]:
    import transformers as T

    from dspark_compile import VerifyLayout, dspark_compile
    from dspark_compile.frontend.own_forward import config_token_ids
    from dspark_compile.zoo.tiny import tiny_config

    cls = getattr(T, architecture)
    tiny = tiny_config(model_type, cls)
    torch.manual_seed(0)
    model = cls._from_config(tiny.config, attn_implementation="eager",
                             dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().num_embeddings
    special = sorted(i for i in config_token_ids(tiny.config.to_dict()) if 0 <= i < vocab)
    if not special:
        return "no-special", ""
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
        return "hf-fails", f"{type(err).__name__}: {str(err)[:120]}"
    verifier = dspark_compile(model)
    state = verifier.new_state(max_requests=1, max_context=64)
    extra = {} if verifier.adapter.mrope is None else {"mrope_deltas": [0]}
    layout = VerifyLayout.pack([6], [0], [0], **extra)
    verifier(prompt, layout, state)
    verifier.commit(layout, [6], state)
    got = verifier(draft, VerifyLayout.pack([DRAFT], [6], [0], **extra), state)
    err = (got.float() - want).abs().max().item()
    return ("ok" if err <= TOLERANCE else "wrong"), f"{err:.1e}, special ids {special}"


def _worker(model_type, architecture, queue):
    try:
        queue.put(check(model_type, architecture))
    except Exception as err:  # noqa: BLE001 - a row, not a crash of the run
        queue.put(("error", f"{type(err).__name__}: {str(err)[:200]}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", default="benchmarks/results/zoo.json")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--out", default="benchmarks/results/drafted_special_tokens_cpu.json")
    args = parser.parse_args()
    zoo = json.load(open(args.zoo))
    todo = [(r["model_type"], r["architecture"]) for r in zoo["rows"]
            if r["status"] == "exact" and r["name"] == r["model_type"]]
    ctx = mp.get_context("fork")
    running, rows = [], []
    while todo or running:
        while todo and len(running) < args.jobs:
            model_type, arch = todo.pop(0)
            queue = ctx.Queue()
            proc = ctx.Process(target=_worker, args=(model_type, arch, queue))
            proc.start()
            running.append((model_type, arch, proc, queue, time.monotonic()))
        for item in list(running):
            model_type, arch, proc, queue, start = item
            if proc.is_alive() and time.monotonic() - start < args.timeout:
                continue
            if proc.is_alive():
                proc.kill()
                status, detail = "timeout", ""
            else:
                status, detail = queue.get() if not queue.empty() else ("died", "")
            running.remove(item)
            rows.append({"model_type": model_type, "architecture": arch, "status": status,
                         "detail": detail})
            print(f"{model_type:28} {status:10} {detail}", flush=True)
        time.sleep(0.05)
    from dspark_compile.zoo.report import environment

    counts = {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})}
    report = {"environment": environment("cpu"),
              "command": " ".join(["python"] + sys.argv), "zoo": zoo["environment"],
              "tolerance": TOLERANCE, "counts": counts,
              "rows": sorted(rows, key=lambda r: r["model_type"])}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(counts)
    return 1 if counts.get("wrong") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
