"""Aria's experts as transformers 5.17 writes them (a host loop over the experts) as the
experts ops.

``frontend/aria.py`` replaces 5.17's ``AriaExperts.forward`` for the capture with its routing
as written, one route, the up projection, the SiLU product and the down projection. Every
ragged logit row equals HF's forward over that request's whole sequence alone (float32, CPU,
reference ops); an experts forward of other source is refused naming the module. transformers
5.24 writes Aria's experts through the experts interface, so these tests run where the installed
transformers has 5.17's form (the GPU machine's) and skip elsewhere.
"""

import pytest
import torch

from dspark_compile import dspark_compile
from dspark_compile.frontend.aria import KNOWN_SOURCES
from dspark_compile.frontend.replaced import source_key
from helpers import ragged_rounds_error

aria = pytest.importorskip("transformers.models.aria.modeling_aria")
if not hasattr(aria.AriaExperts, "route_tokens_to_experts") or \
        source_key(aria.AriaExperts) not in KNOWN_SOURCES[("AriaExperts", "forward")]:
    pytest.skip("this transformers writes Aria's experts through the experts interface",
                allow_module_level=True)

VOCAB = 89


def tiny_aria():
    from transformers import AriaTextConfig

    torch.manual_seed(0)
    cfg = AriaTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1,
                         max_position_embeddings=256, pad_token_id=0)
    model = aria.AriaTextForCausalLM(cfg).eval()
    with torch.no_grad():  # HF may initialise the grouped expert weights to zero
        for name, p in model.named_parameters():
            if ".experts.fc" in name:
                p.normal_(0.0, 0.1)
    return model


def test_experts_verify_as_the_ops_and_equal_hf():
    model = tiny_aria()
    verifier = dspark_compile(model)
    targets = [str(n.target) for n in verifier.graph_module.graph.nodes
               if n.op == "call_function"]
    assert sum("experts_up" in t for t in targets) == 2  # one per layer, gate and up stacked
    err = ragged_rounds_error(model, verifier, [1, 0, 2], [7, 4, 9], VOCAB, seed=5)
    assert err < 1e-4, f"max |ragged - HF| = {err}"


def test_an_experts_forward_of_other_source_is_refused(monkeypatch):
    original = aria.AriaExperts.forward

    def forward(self, hidden_states, router_logits):
        return original(self, hidden_states, router_logits)

    monkeypatch.setattr(aria.AriaExperts, "forward", forward)
    with pytest.raises(NotImplementedError, match=r"AriaExperts 'model\.layers\.0\.mlp\.experts': "
                                                  r"Aria's experts are captured from"):
        dspark_compile(tiny_aria())
