"""The integration examples run on SmolLM2 (their loops as written; the model and verifier are
the session's, so nothing is loaded or compiled twice)."""

import pathlib
import sys

import pytest

from smollm2_setup import NEW_TOKENS, greedy, smollm2

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

import engine_hook_lookup  # noqa: E402
import hf_generate  # noqa: E402

pytestmark = pytest.mark.xdist_group("smollm2")


def test_hf_generate_example_matches_plain_generate(capsys):
    model, tokenizer, verifier, _ = smollm2()
    assert hf_generate.run(model, tokenizer, verifier, prompts=hf_generate.PROMPTS[:1],
                           max_new_tokens=12)
    out = capsys.readouterr().out
    assert "prompt lookup" in out and "assistant" in out and "False" not in out


def test_engine_hook_example_serves_a_queue_losslessly(capsys):
    _, tokenizer, verifier, prompts = smollm2()
    order = [0, 2, 1]  # three requests over two slots: one waits for a slot to free
    outs = engine_hook_lookup.serve(verifier, tokenizer, [prompts[i] for i in order], slots=2,
                                    max_new_tokens=NEW_TOKENS)
    assert [tuple(o) for o in outs] == [greedy(i) for i in order]
    assert "widths" in capsys.readouterr().out
