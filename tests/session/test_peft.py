"""PEFT LoRA layers under a built verifier: exact while their adapter state stands, refused
once it changes.

A LoRA layer's forward reads Python state (adapters disabled, active, merged, their scaling)
that the captured graphs freeze; each change is ``StaleWeightsError`` naming the layer, and
restoring it serves again. Adapter weights updated in place are served, as any weight. Tuner
layers the library cannot watch (DoRA, IA3) are refused before the capture, by name.
"""

from __future__ import annotations

import pytest
import torch

from dspark_compile import StaleWeightsError, VerifyLayout, dspark_compile
from helpers import full_logits, tiny_llama

peft = pytest.importorskip("peft")

VOCAB = 97
TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_llama(**extra):
    model = tiny_llama(seed=3, layers=2, vocab=VOCAB)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                          **extra)
    wrapped = peft.get_peft_model(model, cfg).eval()
    return wrapped, wrapped.base_model.model


def _call(verifier, state, seq):
    return verifier(seq, VerifyLayout.pack([len(seq)], [0], [0]), state)


def _built(length: int, seed: int):
    """A LoRA model, its verifier, a state and a ``length``-token sequence."""
    wrapped, model = lora_llama()
    verifier = dspark_compile(model)
    state = verifier.new_state(max_requests=2, max_context=16)
    seq = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))
    return wrapped, model, verifier, state, seq


def test_lora_verifies_exactly_and_every_adapter_state_change_is_refused():
    wrapped, model, verifier, state, seq = _built(4, 0)
    with_lora = full_logits(model, seq)
    torch.testing.assert_close(_call(verifier, state, seq), with_lora, rtol=1e-4, atol=1e-4)
    changes = [
        (wrapped.base_model.disable_adapter_layers, wrapped.base_model.enable_adapter_layers,
         r"'model.layers.0.self_attn.q_proj' \(disable_adapters False -> True\)"),
        (wrapped.merge_adapter, wrapped.unmerge_adapter, r"merged_adapters \[\] -> \['default'\]"),
        (lambda: model.model.layers[1].mlp.down_proj.set_scale("default", 3.0),
         lambda: model.model.layers[1].mlp.down_proj.set_scale("default", 1.0),
         r"'model.layers.1.mlp.down_proj' \(scaling \{'default': 2.0\} -> \{'default': 6.0\}\)"),
    ]
    for change, restore, match in changes:
        change()
        if change == wrapped.merge_adapter:  # the same logits, from other weights: the graphs
            torch.testing.assert_close(full_logits(model, seq), with_lora)  # would add twice
        else:
            assert not torch.allclose(full_logits(model, seq), with_lora, atol=1e-3)
        with pytest.raises(StaleWeightsError, match=match):
            _call(verifier, state, seq)
        restore()
        torch.testing.assert_close(_call(verifier, state, seq), full_logits(model, seq),
                                   rtol=1e-4, atol=1e-4)


def test_adapter_weights_updated_in_place_are_served():
    _, model, verifier, state, seq = _built(5, 1)
    before = full_logits(model, seq)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.lora_B["default"].weight.mul_(3.0)
    after = full_logits(model, seq)
    assert not torch.allclose(before, after, atol=1e-3)
    torch.testing.assert_close(_call(verifier, state, seq), after, rtol=1e-4, atol=1e-4)


def test_merge_and_unload_after_the_build_is_refused():
    wrapped, _, verifier, state, seq = _built(3, 2)
    _call(verifier, state, seq)
    wrapped.merge_and_unload()  # the LoRA layers replaced by plain ones
    with pytest.raises(StaleWeightsError, match="was replaced|is gone"):
        _call(verifier, state, seq)


@pytest.mark.parametrize("make, match", [
    (lambda: lora_llama(use_dora=True)[1], r"has LoRA variants \['default'\]"),
    (lambda: peft.get_peft_model(tiny_llama(seed=3, layers=1, vocab=VOCAB), peft.IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
     ).base_model.model, r"is a peft\.tuners\.ia3\.layer\.Linear"),
], ids=["dora", "ia3"])
def test_tuner_layers_it_cannot_watch_are_refused_by_name(make, match):
    with pytest.raises(NotImplementedError, match=r"PEFT layer 'model\.layers\.0\.\w+\.\w+' "
                                                  + match):
        dspark_compile(make())


def test_the_peft_wrapper_itself_is_refused_naming_the_model_to_pass():
    wrapped, _ = lora_llama()
    with pytest.raises(TypeError, match=r"PeftModel\w* wraps LlamaForCausalLM: pass "
                                        r"model\.get_base_model\(\)"):
        dspark_compile(wrapped)


def test_a_lora_forward_of_unknown_source_is_refused(monkeypatch):
    """The adapter state watched is what PEFT 0.19-0.21's LoRA forward reads; another forward
    (another PEFT release, a patch) may read more, so it is refused naming its source."""
    from peft.tuners.lora import layer

    original = layer.Linear.forward

    def forward(self, x, *args, **kwargs):
        return original(self, x, *args, **kwargs)

    monkeypatch.setattr(layer.Linear, "forward", forward)
    with pytest.raises(NotImplementedError, match=r"PEFT layer 'model\.layers\.0\.self_attn\."
                                                  r"q_proj' is PEFT [\d.]+'s LoRA Linear, whose "
                                                  r"forward \(sha256 \w+\) is not the one"):
        dspark_compile(lora_llama()[1])
