"""A fixed subset of the model zoo verifies exact (never refused, wrong or an error), plus
the runner's time limit, the refusal classification, the CLI and the generated README
section."""

from __future__ import annotations

import json

import pytest

from dspark_compile.__main__ import main
from dspark_compile.zoo import Entry, Result, check, select
from dspark_compile.zoo.check import PROMPTS, ROUNDS, classify
from dspark_compile.zoo.report import BEGIN, END, markdown, update_readme

SUBSET = {
    "llama": "the reference family",
    "qwen2": "attention bias",
    "mixtral": "MoE experts as batched matmuls",
    "gpt2": "learned absolute positions, fused qkv (Conv1D)",
    "mistral": "a sliding window (8) shorter than the sequences",
    "qwen2_moe+window": "a window that lives only in the mask (was verified wrong)",
    "gpt_oss": "attention sinks, alternating windows, MoE (was verified wrong)",
    "gemma2": "logit softcap, alternating windows",
    "deepseek_v3": "MLA (q/k head dim 24, v 16), MoE with a dense first layer",
    "gemma3": "the multimodal class on text: x[mask] = 0 on token ids (was refused)",
}
"""Each verified exact at 37a670d; the feature each one holds down."""


@pytest.mark.parametrize("name", SUBSET)
def test_zoo_subset_is_exact(name):
    (entry,) = [e for e in select([name]) if e.name == name]
    result = check(entry)
    assert result.status == "exact", (SUBSET[name], result.status, result.reason, result.where)
    assert result.max_error <= 1e-5
    assert result.rows == sum(PROMPTS) + sum(sum(lens) for lens, _ in ROUNDS)


def _entry(name):
    (entry,) = [e for e in select([name]) if e.name == name]
    return entry


def test_select_names_model_types_variants_and_classes():
    assert [e.name for e in select(["qwen2"])] == ["qwen2", "qwen2+window"]
    assert "llama" in [e.name for e in select(["LlamaForCausalLM"])]
    with pytest.raises(ValueError, match="close: .*llama"):
        select(["lama"])


def test_refusal_is_the_library_raising_not_an_escaping_exception():
    from dspark_compile import VerifyLayout

    with pytest.raises(ValueError) as own:
        VerifyLayout.pack([0], [0], [0])  # raised by dspark_compile/layout.py
    assert classify(own.value)[0] == "refused"
    with pytest.raises(ValueError) as foreign:
        int("x")  # a ValueError from outside the package is a bug, not a refusal
    status, reason, _ = classify(foreign.value)
    assert status == "error" and reason.startswith("ValueError: invalid literal")


def test_a_hooked_model_is_refused_not_an_error():
    from dspark_compile import HookedModelError, dspark_compile
    from helpers import tiny_llama

    model = tiny_llama(layers=1)
    model.model.norm.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(HookedModelError) as hooked:
        dspark_compile(model)
    status, reason, _ = classify(hooked.value)
    assert status == "refused" and "model.norm's forward hook" in reason


def test_runner_kills_a_check_past_its_time_limit():
    from dspark_compile.zoo.runner import run_checks

    (result,) = run_checks([_entry("llama")], jobs=1, timeout=0.5, preload=[])
    assert result.status in ("skipped", "error") and "timed out after" in result.reason


def _report(rows):
    return {"environment": {"transformers": "5.24.0", "torch": "2.13", "dspark_compile": "abc"},
            "jobs": 2, "wall_seconds": 1.0, "rows": rows}


def _row(name, status, reason="", err=None):
    return Result(name, name, "XForCausalLM", status, reason, max_error=err).to_json()


def test_markdown_and_readme_section(tmp_path):
    report = _report([_row("llama", "exact", err=1e-7), _row("gpt2", "refused", "no x"),
                      _row("bad", "wrong", "max |ragged - HF| = 0.2"), _row("boom", "error",
                                                                            "KeyError: 1")])
    text = markdown(report)
    assert "## Wrong and error" in text and "| `bad` | wrong |" in text
    assert "1 exact, 1 refused, 1 wrong, 1 error, 0 skipped of 4" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Supported models\n\n{BEGIN}\nold\n{END}\n\nrest\n")
    update_readme(str(readme), report)
    new = readme.read_text()
    assert new.startswith("# x\n\n## Supported models\n\n" + BEGIN) and new.endswith("\n\nrest\n")
    assert "old" not in new and "`llama`" in new and "**Wrong**" in new and "`bad`" in new
    assert "exact tie" not in new and "or a tie" in text
    # an exact row with ties: the README's rule says so
    tied = dict(_row("dsv4", "exact", err=0.02), tie_rows=8)
    update_readme(str(readme), _report([tied]))
    assert "give two ways: an exact tie" in " ".join(readme.read_text().split())
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no zoo section"):
        update_readme(str(readme), report)


def test_cli_writes_markdown_and_readme_from_a_saved_report(tmp_path, capsys):
    saved = tmp_path / "zoo.json"
    saved.write_text(json.dumps(_report([_row("llama", "exact", err=1e-7)])))
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    md = tmp_path / "docs" / "models.md"
    assert main(["zoo", "--from", str(saved), "--markdown", str(md),
                 "--update-readme", str(readme)]) == 0
    assert "| `llama` | `XForCausalLM` | exact | 1.0e-07 |" in md.read_text()
    assert "[docs/models.md](docs/models.md)" in readme.read_text()
    assert main(["zoo", "--list", "--only", "gpt2"]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    assert main(["zoo", "--list", "--variants", "--variant", "rope_yarn", "--variant", "mqa",
                 "--only", "llama", "gpt2"]) == 0  # GPT-2 has neither switch
    assert capsys.readouterr().out.split()[::2] == ["llama+mqa", "llama+rope_yarn"]
    with pytest.raises(ValueError, match="--variant rope_yarn needs --variants"):
        main(["zoo", "--list", "--variant", "rope_yarn", "--only", "llama"])
    # --combos: the entries and then each type's combinations of three switches
    assert main(["zoo", "--list", "--combos", "2", "--seed", "1", "--only", "llama"]) == 0
    names = capsys.readouterr().out.split()[::2]
    assert names[0] == "llama" and len(names) == 3
    assert all(n.startswith("llama+") and n.count("+") == 3 for n in names[1:])
    with pytest.raises(ValueError, match="--combos -1"):
        main(["zoo", "--list", "--combos", "-1", "--only", "llama"])


def test_gpu_runs_are_judged_by_the_gpu_bound_and_say_so():
    from dspark_compile.zoo.check import GPU_TOLERANCE, TOLERANCE, tolerance

    assert tolerance("cpu") == TOLERANCE < GPU_TOLERANCE == tolerance("cuda") == \
        tolerance("cuda:1")
    report = _report([_row("llama", "exact", err=1e-4)])
    report.update(device="cuda", tolerance=GPU_TOLERANCE)
    assert f"≤ {GPU_TOLERANCE:g} over all rows (on cuda)" in markdown(report)
    assert f"≤ {TOLERANCE:g} over all rows (on cpu)" in markdown(_report([]))


def test_variants_set_the_switches_the_config_has():
    from dspark_compile.zoo.variants import variant_entries

    chosen = variant_entries(select(["llama", "gpt2"]))
    llama = {e.variant: dict(e.overrides) for e in chosen if e.model_type == "llama"}
    assert {"", "bias", "mqa", "head_dim32", "rope_yarn", "rope_dynamic", "eps"} <= set(llama)
    assert "window5" not in llama and "final_softcap" not in llama  # Llama has neither field
    assert llama["mqa"] == {"num_key_value_heads": 1}
    assert llama["rope_dynamic"]["rope_parameters"]["rope_type"] == "dynamic"
    assert llama["rope_dynamic"]["max_position_embeddings"] == 8
    # GPT-2 has none of the rotary or attention-bias fields
    assert not {"rope_yarn", "bias", "mqa"} & {e.variant for e in chosen if e.model_type == "gpt2"}
    # a scaled variant keeps the fields the model reads outside its rotary (Ministral 3's Llama-4
    # attention scaling) and drops the old type's own
    (yarn,) = [dict(e.overrides)["rope_parameters"] for e in variant_entries(
        select(["ministral3"])) if e.variant == "rope_yarn"]
    assert yarn["rope_type"] == "yarn" and "llama_4_scaling_beta" in yarn and "type" not in yarn
    assert yarn["original_max_position_embeddings"] == 8
    # DeepSeek-V3's routing switches and MLA without the query LoRA; Llama has no experts
    deepseek = {e.variant: dict(e.overrides) for e in variant_entries(select(["deepseek_v3"]))}
    assert deepseek["top1"] == {"num_experts_per_tok": 1}
    assert deepseek["route_groups"] == {"n_group": 2, "topk_group": 1}
    assert deepseek["norm_topk"] == {"norm_topk_prob": False}
    assert deepseek["no_q_lora"] == {"q_lora_rank": None}
    assert deepseek["shared2"] == {"n_shared_experts": 2}
    (v2,) = [dict(e.overrides) for e in variant_entries(select(["deepseek_v2"]))
             if e.variant == "group_limited"]
    assert v2 == {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}
    assert not {"top1", "route_scale", "no_q_lora"} & set(llama)
    # Falcon-H1's muP multipliers, each away from 1 and from the others
    (mults,) = [dict(e.overrides) for e in variant_entries(select(["falcon_h1"]))
                if e.variant == "multipliers"]
    values = [v for x in mults.values() for v in (x if isinstance(x, list) else [x])]
    assert len(mults["ssm_multipliers"]) == 5 and len(set(values)) == len(values)
    assert 1.0 not in values


def test_combinations_join_switches_on_different_fields_and_repeat_by_seed():
    from dspark_compile.zoo.variants import REFUSED_VARIANTS, combo_entries, variant_entries

    base = select(["llama", "qwen3"])
    combos = combo_entries(base, 5, seed=3)
    assert combos == combo_entries(base, 5, seed=3)  # the seed reproduces the draw
    assert combos != combo_entries(base, 5, seed=4)
    singles = {(e.model_type, e.variant): e.overrides for e in variant_entries(base)}
    for model_type in ("llama", "qwen3"):
        mine = [e for e in combos if e.model_type == model_type]
        assert len(mine) == 5 and len({e.variant for e in mine}) == 5
    for entry in combos:
        parts = entry.variant.split("+")
        assert len(parts) == 3 and parts == sorted(parts)
        assert not REFUSED_VARIANTS & set(parts)
        # the overrides are the parts' own, and no field is set twice
        assert entry.overrides == tuple(kv for p in parts for kv in singles[entry.model_type, p])
        keys = [k for k, _ in entry.overrides]
        assert len(keys) == len(set(keys)), entry
    assert combo_entries(base, 0, seed=0) == []
    # GPT-2 has few switches (no rotary, bias or KV-head fields): its combinations too set each
    # field once
    for entry in combo_entries(select(["gpt2"]), 3, seed=0):
        keys = [k for k, _ in entry.overrides]
        assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name,status", [("llama+mqa", "exact"), ("llama+rope_yarn", "exact"),
                                         ("llama+rope_dynamic", "refused"),
                                         ("gemma4_text+vocab131", "exact"),
                                         ("gemma3_text+rope_linear", "exact"),
                                         ("mllama+vocab131", "exact"),
                                         ("beam+rope_linear", "exact"),
                                         ("granite+multipliers", "exact")])
def test_a_variant_checks_its_switch(name, status):
    """``gemma4_text+vocab131`` once lengthened the vocabulary and not Gemma 4's per-layer token
    table, so the check drew ids past that table's end and crashed (an ``error`` row); Gemma 3's
    rotary field is keyed by layer type, and a scaled variant once replaced it whole (HF's config
    then failed: no check ran), and Beam's full-attention layers have none (``None`` in that
    field); Mllama embeds 8 image tokens past its logits' vocabulary, which
    the verifier once refused as out of vocabulary (the check draws id 137 of 139 rows)."""
    from dspark_compile.zoo.variants import variant_entries

    (entry,) = [e for e in variant_entries(select([name.split("+")[0]])) if e.name == name]
    if name == "gemma4_text+vocab131":
        assert dict(entry.overrides) == {"vocab_size": 131, "vocab_size_per_layer_input": 131}
    if name == "gemma3_text+rope_linear":
        rope = dict(entry.overrides)["rope_parameters"]
        assert rope["full_attention"]["rope_type"] == "linear"
        assert rope["sliding_attention"]["rope_type"] == "default"
    result = check(entry)
    assert result.status == status, (result.reason, result.message[:300])
    if status == "refused":
        assert "rope_type='dynamic'" in result.reason


def test_reference_logits_come_from_the_call_generate_makes():
    """HF's forward is called with an all-ones attention mask, as ``generate`` calls it: some
    models build no causal mask without one (transformers 5.17's Moshi attended to every
    token)."""
    import sys

    import torch

    seen = {}

    class Stub(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, use_cache=None):
            seen.update(ids=input_ids, mask=attention_mask, use_cache=use_cache)
            return type("Out", (), {"logits": torch.zeros(1, input_ids.shape[1], 3)})()

    check_module = sys.modules["dspark_compile.zoo.check"]
    logits = check_module._hf_logits(Stub(), torch.tensor([5, 6, 7]))
    assert logits.shape == (3, 3) and seen["use_cache"] is False
    assert torch.equal(seen["mask"], torch.ones(1, 3, dtype=torch.int64))


def test_equivalent_forwards_measure_how_far_hf_itself_moves_a_row():
    """A causal model gives a row the same logits over the whole sequence, over the sequence cut
    right after it, and through its cache after the chunks before it; a model whose row depends
    on the sequence's length (an exact tie its top-k breaks by the length) does not."""
    import sys

    import torch

    check_module = sys.modules["dspark_compile.zoo.check"]
    calls = []

    class Stub(torch.nn.Module):
        def __init__(self, by_length: bool):
            super().__init__()
            self.by_length = by_length

        def forward(self, input_ids, attention_mask=None, use_cache=None, past_key_values=None):
            start = past_key_values or 0
            total = start + input_ids.shape[1]
            calls.append((start, input_ids.shape[1]))
            pos = torch.arange(start, total, dtype=torch.float32)
            row = pos[:, None] * torch.ones(1, 3)  # causal: each row from its position alone
            if self.by_length:  # and, past position 2, from how many tokens the call takes
                row = row + (pos[:, None] > 2) * 0.1 * input_ids.shape[1]
            out = type("Out", (), {})()
            out.logits, out.past_key_values = row[None], total
            return out

    seq = torch.arange(7)
    # by length: the whole call (7 tokens) adds 0.7, the cuts 0.5 and 0.6, the cached call over
    # the last 3 rows 0.3: each row moves by 0.4 at most
    for by_length, moved in ((False, [0.0, 0.0, 0.0]), (True, [0.4, 0.4, 0.4])):
        model = Stub(by_length)
        want = check_module._hf_logits(model, seq)[-3:]
        calls.clear()
        got = check_module._equivalent_errors(model, seq, 3, want, [2, 2])
        assert got.tolist() == pytest.approx(moved, abs=1e-6), (by_length, got)
        # the rows cut after rows 4 and 5, then the cache: 2 + 2 tokens, then the last 3
        assert calls == [(0, 5), (0, 6), (0, 2), (2, 2), (4, 3)]


def test_the_judge_replays_verify_steps_through_a_cropped_cache():
    """``steps`` (each verify step's tokens, drafts included, and how many were accepted): HF
    runs each step whole through one cache, the rejected drafts cropped off (sliding layers
    told to keep what a crop needs first), then the rows judged. A model whose rows depend on
    what its cache once held moves by that much; the accepted-chunks replay does not see it."""
    import sys

    import torch

    check_module = sys.modules["dspark_compile.zoo.check"]
    calls = []

    class Layer:
        recording = False

        def activate_past_recording(self):
            self.recording = True

    class Cache:
        def __init__(self):
            self.length, self.crops, self.layers = 0, 0, [Layer()]

        def crop(self, count):
            assert count < 0 and self.layers[0].recording
            calls.append(("crop", count))
            self.length += count
            self.crops += 1

    class Stub(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, use_cache=None, past_key_values=None):
            cache = past_key_values if past_key_values is not None else Cache()
            start = cache.length if use_cache else 0
            calls.append((start, input_ids.shape[1]))
            pos = torch.arange(start, start + input_ids.shape[1], dtype=torch.float32)
            row = pos[:, None] * torch.ones(1, 3) + 0.05 * cache.crops
            cache.length = start + input_ids.shape[1]
            out = type("Out", (), {})()
            out.logits, out.past_key_values = row[None], cache
            return out

    seq = torch.arange(9)  # 4 prompt tokens, 2 accepted of a 3-token step, then 3 judged rows
    model = Stub()
    want = check_module._hf_logits(model, seq)[-3:]
    calls.clear()
    steps = [(torch.arange(4), 4), (torch.tensor([4, 5, 99]), 2)]
    got = check_module._equivalent_errors(model, seq, 3, want, [4, 2], steps)
    assert got.tolist() == pytest.approx([0.05] * 3, abs=1e-6)
    assert calls[-4:] == [(0, 4), (4, 3), ("crop", -1), (6, 3)]


def test_a_tie_hf_breaks_by_the_sequences_length_is_not_wrong():
    """DeepSeek-V4 under one KV head of 16 in a width of 112 with MLP biases: its lightning
    indexer scores two compressed entries of one query exactly zero (ReLU) and keeps the top 2
    of three; torch.topk picks one of the two tied entries over 12 tokens and the other over
    16, so HF's own forward over a request's whole sequence differs from its forward through
    its cache by 0.025 on 8 rows. The verifier agrees with the cached forward; the rows are
    ties, not wrong ones."""
    from dspark_compile.zoo.variants import variant_entries

    singles = {e.variant: e for e in variant_entries(select(["deepseek_v4"]))}
    (base,) = select(["deepseek_v4"])
    overrides = singles["group7"].overrides + singles["mlp_bias"].overrides
    result = check(Entry(base.model_type, base.architecture, "group7+mlp_bias", overrides))
    assert result.status == "exact", (result.reason, result.message[:300])
    assert result.tie_rows and result.max_error > 1e-3, result
    assert "near-ties" in result.reason and "cut short, through its cache" in result.reason


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_checks_judge_against_float32_relative_to_hfs_own_rounding(dtype):
    import torch

    from dspark_compile.zoo.check import HALF_RATIO, HALF_FLOOR

    result = check(_entry("llama"), dtype=dtype)
    assert result.status == "exact", (result.reason, result.message[:300])
    floor = HALF_FLOOR[getattr(torch, dtype)]
    assert 0 < result.hf_error and result.max_error <= HALF_RATIO * result.hf_error + floor
    assert result.max_error > 1e-5  # it did run in half precision
    report = _report([_row("llama", "exact", err=4e-3)])
    report.update(dtype=dtype, device="cuda")
    assert f"verified in {dtype} on cuda" in markdown(report)
    assert f"error on that row + {floor:g}" in markdown(report)
    with pytest.raises(ValueError, match="dtype='float64'; the zoo verifies in"):
        check(_entry("llama"), dtype="float64")


def test_a_copy_outside_its_checkout_names_its_commit(monkeypatch):
    from dspark_compile.zoo.report import environment

    monkeypatch.setenv("DSPARK_COMMIT", "abc1234")
    assert environment()["dspark_compile"] == "abc1234"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_rows_off_everywhere_are_wrong_not_near_ties(monkeypatch, dtype):
    """A verifier 5% off in its final norm is off on every row, and HF's own perturbed
    half-precision forward moves no row that far: wrong, with no row excused as a near-tie."""
    import copy
    import sys

    import torch

    verifier_module = sys.modules["dspark_compile.verifier"]
    real = verifier_module.dspark_compile

    def skewed(model, **kwargs):
        own = copy.deepcopy(model)  # the verifier's weights only; HF's stay as they were
        with torch.no_grad():
            own.model.norm.weight.mul_(1.05)
        return real(own, **kwargs)

    monkeypatch.setattr(verifier_module, "dspark_compile", skewed)
    result = check(_entry("llama"), dtype=dtype)
    assert result.status == "wrong" and result.tie_rows == 0
    assert result.off_rows == result.rows


def test_a_scripted_list_may_leave_out_names_this_transformers_lacks(capsys):
    with pytest.raises(ValueError, match="no such architecture in this transformers: nosuch"):
        select(["llama", "nosuch"])
    chosen = select(["llama", "nosuch"], skip_unknown=True)
    assert [e.name for e in chosen] == ["llama"]
    assert "left out, no such architecture in this transformers: nosuch" in \
        capsys.readouterr().err


def test_a_stopped_run_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """The report is rewritten, marked partial, while checks run: a run killed by its time
    limit leaves the finished rows on disk instead of nothing."""
    import dspark_compile.zoo as zoo
    import dspark_compile.zoo.runner as runner

    def two_then_killed(selected, on_result, **_):
        for entry in selected[:2]:
            on_result(Result(entry.name, entry.model_type, entry.architecture, "exact",
                             max_error=1e-7))
        raise KeyboardInterrupt  # what a time limit's signal ends the run with

    monkeypatch.setattr(runner, "run_checks", two_then_killed)
    monkeypatch.setattr(zoo, "PARTIAL_EVERY_S", -1.0)
    out = tmp_path / "zoo.json"
    with pytest.raises(KeyboardInterrupt):
        main(["zoo", "--only", "llama", "gpt2", "qwen2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["partial"] == f"2 of {len(select(['llama', 'gpt2', 'qwen2']))} checks"
    assert [r["name"] for r in saved["rows"]] == ["llama", "gpt2"]
    assert saved["environment"]["dspark_compile"] and "gpu" not in saved["environment"]


@pytest.mark.parametrize("name", ["qwen3_next", "gpt_oss"])
def test_a_static_check_verifies_through_the_tier_session(name, monkeypatch):
    """``static=True`` verifies through ``Verifier.capture``'s session (padded static buffers on
    the CPU): the rounds run in tiers, with padded rows, and stay exact."""
    from dspark_compile.session.graphs import TierGraphs

    calls = []
    real = TierGraphs.fill  # a tier's static buffers filled: the batch ran padded in that tier

    def counted(self, tier, *args, **kwargs):
        calls.append(tier)
        return real(self, tier, *args, **kwargs)

    monkeypatch.setattr(TierGraphs, "fill", counted)
    result = check(_entry(name), static=True)
    assert result.status == "exact", (result.reason, result.message[:300])
    assert len(calls) >= len(ROUNDS), "the verify rounds went through the tier session"
    assert any(t.tokens > sum(lens) for t, (lens, _) in zip(calls, ROUNDS)), "rows were padded"


def test_a_model_whose_decoding_is_not_its_forward_is_wrong(monkeypatch):
    """The zoo also decodes one token a call through HF's own cache and compares it with the
    forward: Moshi's sliding-window cache under a plain causal mask decodes otherwise past its
    window. With the verifier's cache-window limit taken out, the verifier matches the forward
    exactly and the zoo still calls the model wrong; Llama's decoding is its forward."""
    import dspark_compile.frontend.capture as capture

    monkeypatch.setattr(capture, "cache_window_limit", lambda model, specs: None)
    result = check(Entry("moshi", "MoshiForCausalLM"))
    assert result.status == "wrong" and result.decode_rows, (result.status, result.reason)
    assert result.off_rows == 0
    assert "HF's own one-token cached decoding differs from its forward" in result.reason
    llama = check(Entry("llama", "LlamaForCausalLM"))
    assert llama.status == "exact" and llama.decode_rows == 0 and llama.decode_error < 1e-5
