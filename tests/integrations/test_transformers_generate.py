"""HF ``generate`` through the adapter (dspark_compile.integrations.transformers).

On SmolLM2: plain greedy, prompt lookup and an assistant model decode exactly plain greedy
``generate``'s tokens; under sampling, a fixed seed gives HF's own assisted tokens. On a tiny
random Llama: the refusals, cache bookkeeping, and a statistical test that sampling through
the adapter with prompt lookup draws from plain sampling's distribution.
"""

import pytest
import torch
from transformers import DynamicCache

from dspark_compile import dspark_compile
from dspark_compile.engine.early_exit import early_exit_model
from dspark_compile.integrations.transformers import (DSparkCache, DSparkGeneration,
                                                      UnsupportedGenerationError)
from helpers import tiny_llama
from smollm2_setup import NEW_TOKENS, as_batch, greedy, smollm2


def assistant_of(model, layers: int = 8):
    """The target's first ``layers`` layers as an HF assistant drafting 4 tokens a step (HF's
    default schedule starts at 20, which a weak assistant mostly wastes)."""
    assistant = early_exit_model(model, layers)
    assistant.generation_config.num_assistant_tokens = 4
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant

pytestmark = pytest.mark.xdist_group("smollm2")


@pytest.fixture(scope="module")
def adapter():
    model, tokenizer, verifier, prompts = smollm2()
    return DSparkGeneration(model, verifier, max_context=256)


def _new(out, prompt):
    return tuple(out[0, prompt.numel():].tolist())


@pytest.mark.parametrize("index", [0, 1])
def test_plain_greedy_equals_generate(adapter, index):
    prompt = adapter_prompts()[index]
    out = adapter.generate(**as_batch(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert _new(out, prompt) == greedy(index)
    stats = adapter.last_cache_stats
    assert stats["steps"] == len(greedy(index))  # a prefill, then one token a step


@pytest.mark.parametrize("index", [0, 1, 2])
def test_prompt_lookup_equals_greedy_generate(adapter, index):
    prompt = adapter_prompts()[index]
    out = adapter.generate(**as_batch(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                           prompt_lookup_num_tokens=4)
    assert _new(out, prompt) == greedy(index)
    if index == 0:  # "repeat this sentence": lookup drafts it, so fewer steps than tokens
        assert adapter.last_cache_stats["steps"] < len(greedy(index))


@pytest.mark.parametrize("index", [0, 3])
def test_assistant_model_equals_greedy_generate(adapter, index):
    model = adapter.model
    prompt = adapter_prompts()[index]
    out = adapter.generate(**as_batch(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                           assistant_model=assistant_of(model))
    assert _new(out, prompt) == greedy(index)


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_sampling_with_a_seed_gives_hfs_own_tokens(adapter, how):
    model = adapter.model
    prompt = adapter_prompts()[2]
    extra = {"prompt_lookup_num_tokens": 4} if how == "prompt_lookup" else \
        {"assistant_model": assistant_of(model)}
    kwargs = dict(as_batch(prompt), max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20,
                  temperature=0.8, **extra)
    torch.manual_seed(7)
    want = model.generate(**kwargs)
    torch.manual_seed(7)
    got = adapter.generate(**kwargs)
    assert torch.equal(got, want)


def adapter_prompts():
    return smollm2()[3]


# ---------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama(seed=3, vocab=64)
    with torch.no_grad():  # a sharper random model: drafts that are sometimes right
        model.lm_head.weight.mul_(15.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model, DSparkGeneration(model, dspark_compile(model), max_context=96,
                                   max_requests=2)


def test_refusals_name_the_option(tiny):
    model, gen = tiny
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    cases = [
        (dict(num_beams=2), "num_beams=2"),
        (dict(cache=DynamicCache()), "cache= given"),
        (dict(input_ids=ids.repeat(2, 1)), "a batch of 2"),
        (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1]])), "1 masked positions"),
        (dict(output_hidden_states=True, return_dict_in_generate=True),
         "output_hidden_states=True"),
    ]
    for kwargs, words in cases:
        call = {"input_ids": ids, "max_new_tokens": 3, **kwargs}
        with pytest.raises(UnsupportedGenerationError, match=words):
            gen.generate(**call)
    assert sorted(gen._free) == [0, 1]  # every refused call gave its slot back
    assert "forward" not in model.__dict__  # and the model's forward is HF's again


def test_model_forward_is_hfs_outside_attached_and_for_other_caches(tiny):
    model, gen = tiny
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        plain = model(ids).logits
        with gen.attached():
            other = model(input_ids=ids, cache=DynamicCache()).logits  # not ours: HF runs
            cache = gen.new_cache()
            try:
                mine = model(input_ids=ids, cache=cache).logits
                assert isinstance(cache, DSparkCache) and cache.get_seq_length() == 3
                cache.crop(-1)
                assert cache.committed == 2 and cache.get_seq_length() == 2
                with pytest.raises(ValueError, match="committed"):
                    cache.crop(-1)  # nothing pending: committed rows cannot be dropped
            finally:
                cache.close()
    assert torch.equal(plain, other)
    assert (mine - plain).abs().max().item() < 1e-5
    assert "forward" not in model.__dict__


def test_greedy_lossless_on_tiny_with_lookup_and_assistant(tiny):
    model, gen = tiny
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (1, 12))
    ids = torch.cat([ids, ids[:, :6]], dim=1)  # a repeat for prompt lookup to find
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=20, do_sample=False), want)
    assert torch.equal(gen.generate(ids, max_new_tokens=20, do_sample=False,
                                    prompt_lookup_num_tokens=3), want)
    assistant = assistant_of(model, 1)
    assert torch.equal(gen.generate(ids, max_new_tokens=20, do_sample=False,
                                    assistant_model=assistant), want)


def test_sampling_through_adapter_matches_plain_sampling_distribution(tiny):
    """Chi-square homogeneity of the 2nd sampled token (64-way) between plain sampling (HF, no
    speculation) and sampling through the adapter with prompt lookup (drafts verified by HF's
    rule on the verifier's logits), 300 draws each, bins pooled to >= 5 expected."""
    model, gen = tiny
    # the model's own greedy start: lookup drafts "39 39 39", which it samples 22% of the time
    ids = torch.tensor([[3, 9, 4, 19, 63, 39, 39, 39, 39, 39]])
    kwargs = dict(max_new_tokens=2, do_sample=True, temperature=1.0, top_k=0)
    n = 300
    torch.manual_seed(1)
    plain = [int(model.generate(ids, **kwargs)[0, -1]) for _ in range(n)]
    torch.manual_seed(2)
    ours, one_step = [], 0
    for _ in range(n):
        ours.append(int(gen.generate(ids, prompt_lookup_num_tokens=3, **kwargs)[0, -1]))
        one_step += gen.last_cache_stats["steps"] == 1  # a draft accepted: both tokens at once
    assert one_step >= 20, one_step
    a = torch.bincount(torch.tensor(plain), minlength=64).double()
    b = torch.bincount(torch.tensor(ours), minlength=64).double()
    order = torch.argsort(a + b, descending=True)
    a, b = a[order], b[order]
    keep = ((a + b) / 2 >= 5).sum().item()
    a = torch.cat([a[:keep], a[keep:].sum().view(1)])
    b = torch.cat([b[:keep], b[keep:].sum().view(1)])
    total = a + b
    nonzero = total > 0
    expected = total[nonzero] / 2
    chi2 = (((a[nonzero] - expected) ** 2 + (b[nonzero] - expected) ** 2) / expected).sum()
    dof = int(nonzero.sum()) - 1
    # 99.9th percentile of chi-square(dof), Wilson-Hilferty
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2.item() < limit, (chi2.item(), limit, dof)
    assert not torch.equal(a, b)  # a test of sampling, not of one repeated token


def test_prompt_lookup_on_a_hybrid_model_which_hf_alone_refuses():
    """Qwen3.5 (Gated DeltaNet layers): HF refuses assisted generation for models with recurrent
    state; through the adapter the verifier rolls the rejected drafts back, and prompt lookup
    decodes plain greedy's tokens."""
    from helpers import tiny_qwen35

    model = tiny_qwen35(seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    gen = DSparkGeneration(model, dspark_compile(model), max_context=96)
    torch.manual_seed(0)
    ids = torch.randint(1, 101, (1, 10))
    ids = torch.cat([ids, ids[:, :5]], dim=1)
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    with pytest.raises(ValueError, match="stateful"):
        model.generate(ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    out = gen.generate(ids, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(out, want)
    assert gen.last_cache_stats["steps"] < 20  # drafts were accepted (and the rest rolled back)
    assert "_is_stateful" not in model.__dict__


def test_a_cache_carries_a_conversation_across_generate_calls(tiny):
    """Plain generate continues in the same DSparkCache (only the new tokens are verified);
    assisted generate, which re-feeds the whole sequence on its first step, is refused there."""
    model, gen = tiny
    ids = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with gen.attached():
        cache = gen.new_cache()
        try:
            first = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
            turn = torch.cat([first, torch.tensor([[5, 6, 7]])], dim=1)
            second = model.generate(turn, cache=cache, max_new_tokens=6, do_sample=False)
            assert cache.verified_tokens == 8 + 5 + 4 + 5  # no row of the first turn again
            with pytest.raises(UnsupportedGenerationError, match="re-feeds the whole"):
                model.generate(torch.cat([second, turn[:, -2:]], dim=1), cache=cache,
                               max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=3)
        finally:
            cache.close()
    assert torch.equal(second, model.generate(turn, max_new_tokens=6, do_sample=False))


def test_a_prompt_longer_than_a_step_is_verified_in_chunks():
    """``max_step_tokens=8``: a 21-token prompt runs as chunks of 8, 8 and 5 (the first two
    committed as they go); greedy and prompt-lookup generate still give HF's tokens."""
    model = tiny_llama(seed=3, vocab=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    gen = DSparkGeneration(model, dspark_compile(model, max_step_tokens=8), max_context=96)
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (1, 15))
    ids = torch.cat([ids, ids[:, :6]], dim=1)
    want = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert torch.equal(gen.generate(ids, max_new_tokens=12, do_sample=False,
                                    prompt_lookup_num_tokens=3), want)
    cache = gen.new_cache()
    logits = cache.verify(ids[0])
    assert logits.shape == (21, 64) and cache.steps == 3 and cache.committed == 16
    with pytest.raises(ValueError, match="only the last forward's 5 rows can be dropped"):
        cache.crop(-6)
    cache.close()


def test_the_default_context_follows_a_models_position_table(caplog):
    """GPT-2 serves ``n_positions`` positions: the default ``max_context`` is cut to them, said
    in one log line; a longer one given explicitly is refused by ``new_state``; a rotary model
    keeps the default."""
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel

    from dspark_compile.integrations.transformers import DEFAULT_MAX_CONTEXT

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4,
                                       n_positions=40)).eval()
    verifier = dspark_compile(model)
    with caplog.at_level(logging.INFO, logger="dspark_compile"):
        gen = DSparkGeneration(model, verifier)
    assert gen.state.max_context == 40
    assert "max_context 40, the 40 positions the model's position table transformer.wpe.weight " \
        "(40 rows) serves" in caplog.text
    with pytest.raises(ValueError, match="max_context=41 exceeds the 40 positions"):
        DSparkGeneration(model, verifier, max_context=41)
    llama = tiny_llama(seed=3, layers=1)
    assert DSparkGeneration(llama, dspark_compile(llama)).state.max_context == \
        DEFAULT_MAX_CONTEXT
