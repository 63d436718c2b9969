"""An external engine's greedy speculative-decoding loop driving dspark_compile through the hook.

The engine owns requests, drafting and acceptance; the hook plans lengths, verifies the packed
batch and commits. Prints tokens per step and the plan of each step.

    python examples/engine_hook.py
"""

import torch

from dspark_compile import VerifyLayout, dspark_compile
from dspark_compile.engine import DSparkHook, NoisyCopyDrafter
from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable

# An illustrative cost curve (not a measurement): a step of B tokens takes 1 + 0.01 B ms, so
# verifying a draft pays only when it is likely enough to be accepted. A real engine loads an
# SPS table measured on its GPU and model (dspark_compile.runtime.SpsTable.load).
ILLUSTRATIVE_SPS = SpsTable(SpsMetadata(gpu="illustrative", model="tiny"),
                            tuple(SpsEntry(b, 1000.0 / (1.0 + 0.01 * b)) for b in range(1, 65)))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    with torch.no_grad():  # sharpen the random model so drafts carry real confidence
        model.lm_head.weight.mul_(40.0)
    return model


def generate(model, prompts, new_tokens=12, gamma=4, noise=0.3, verbose=True):
    """Greedy speculative decoding of ``prompts``; returns the emitted tokens per prompt."""
    hook = DSparkHook(dspark_compile(model), max_requests=len(prompts), max_context=128,
                      gamma=gamma, rate=ILLUSTRATIVE_SPS)
    hook.capture()
    drafter = NoisyCopyDrafter(model, noise=noise)
    slots = list(range(len(prompts)))
    layout = VerifyLayout.pack([len(p) for p in prompts], [0] * len(prompts), slots)
    logits = hook.verify(torch.cat(prompts), layout)  # prefill
    hook.commit(layout, [len(p) for p in prompts])
    out = [[int(logits[end - 1].argmax())] for end in layout.query_start_loc[1:].tolist()]
    while min(len(o) for o in out) < new_tokens:
        seqs = [torch.cat([p, torch.tensor(o)]) for p, o in zip(prompts, out)]
        drafts = drafter.draft(seqs, gamma)
        lens = hook.plan(drafts.confidence).tolist()
        rows = [torch.cat([torch.tensor(o[-1:]), drafts.tokens[i, :n - 1]])
                for i, (o, n) in enumerate(zip(out, lens))]
        layout = VerifyLayout.pack(lens, [s.numel() - 1 for s in seqs], slots)
        logits = hook.verify(torch.cat(rows), layout)
        accept, qsl = [], layout.query_start_loc.tolist()
        for i, row in enumerate(rows):  # greedy acceptance: drafts that match the argmax
            best = logits[qsl[i]:qsl[i + 1]].argmax(dim=-1).tolist()
            a = 0
            while a < len(row) - 1 and row[a + 1] == best[a]:
                a += 1
            out[i] += row[1:1 + a].tolist() + [best[a]]
            accept.append(a + 1)
        hook.commit(layout, accept)
        if verbose:
            print(f"plan {lens} -> accepted drafts {[a - 1 for a in accept]}, "
                  f"{sum(accept)} tokens this step")
    return [o[:new_tokens] for o in out]


def main() -> None:
    model = tiny_llama()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (5, 9, 3)]
    print(generate(model, prompts))


if __name__ == "__main__":
    main()
