"""The engine hook, driven the way examples/engine_hook.py drives it: lossless under greedy."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
import engine_hook  # noqa: E402
from dspark_compile import dspark_compile  # noqa: E402
from dspark_compile.engine import DSparkHook  # noqa: E402
from helpers import full_logits  # noqa: E402


def test_example_loop_equals_plain_greedy():
    model = engine_hook.tiny_llama()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=gen) for n in (4, 7)]
    got = engine_hook.generate(model, prompts, new_tokens=8, gamma=3, verbose=False)
    for prompt, tokens in zip(prompts, got):
        seq = prompt.clone()
        for _ in range(8):
            seq = torch.cat([seq, full_logits(model, seq)[-1].argmax().view(1)])
        assert tokens == seq[prompt.numel():].tolist()


def test_plan_refuses_a_wrong_confidence_shape():
    hook = DSparkHook(dspark_compile(engine_hook.tiny_llama()), max_requests=2,
                      max_context=32, gamma=3)
    with pytest.raises(ValueError, match=r"\[R, gamma=3\]"):
        hook.plan(torch.rand(2, 4))
    assert hook.plan(torch.ones(2, 3)).tolist() == [4, 4]  # no SPS table: verify everything


def test_plan_keeps_the_planners_quiet_steps_and_follows_a_swapped_rate(monkeypatch):
    """The hook holds one Planner: after a ranking that did not pay (sure drafts, a rate past
    the flat rule's tolerance) the next quiet_steps plans verify every draft unranked; a rate
    or config the caller assigns later is the one planned with."""
    from dspark_compile.runtime import PlannerConfig, SpsEntry, SpsMetadata, SpsTable
    from dspark_compile.runtime import planner as planner_module

    ranked = []
    real = planner_module._rank
    monkeypatch.setattr(planner_module, "_rank", lambda c: ranked.append(1) or real(c))
    meta = SpsMetadata(gpu="test", model="test")
    table = SpsTable(meta, (SpsEntry(1, 100.0), SpsEntry(2, 100.0), SpsEntry(4, 90.0)))
    hook = DSparkHook(dspark_compile(engine_hook.tiny_llama()), max_requests=2, max_context=32,
                      gamma=3, rate=table, planner=PlannerConfig(quiet_steps=2))
    sure = torch.full((1, 3), 0.99)
    for _ in range(3):
        assert hook.plan(sure).tolist() == [4]
    assert len(ranked) == 1  # one ranking, two quiet steps
    assert hook.plan(sure).tolist() == [4] and len(ranked) == 2
    hook.rate = SpsTable(meta, (SpsEntry(1, 100.0), SpsEntry(4, 10.0)))  # steep: trims
    assert hook.plan(torch.full((1, 3), 0.1)).tolist() == [3] and len(ranked) == 3  # B = 4 too dear
