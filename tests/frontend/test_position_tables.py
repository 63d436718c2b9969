"""Position tables bound the context: a state longer than a model's learned positions is refused
by ``new_state``, naming the table, before any gather could read past its last row.

GPT-2 reads ``wpe[position]``, OPT ``embed_positions[position + 2]``, GPT-J gathers its sin/cos
table at each position repeated over the rotary dims: each serves exactly its
``max_position_embeddings`` positions, and a state of that many tokens verifies equal to HF.
Rotary models have no table and no limit.
"""

import logging

import pytest
import torch
import transformers as T

from dspark_compile import dspark_compile
from dspark_compile.frontend.position_tables import position_limit
from helpers import ragged_rounds_error

VOCAB = 64


def _gpt2(positions):
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4,
                                          n_positions=positions)).eval()


def _opt(positions):
    torch.manual_seed(0)
    return T.OPTForCausalLM(T.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        ffn_dim=64, max_position_embeddings=positions, word_embed_proj_dim=32)).eval()


def _gptj(positions):
    torch.manual_seed(0)
    return T.GPTJForCausalLM(T.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4,
                                          rotary_dim=4, n_positions=positions)).eval()


@pytest.mark.parametrize("build, table, rows", [
    (_gpt2, "transformer.wpe.weight", 24),
    (_opt, "model.decoder.embed_positions.weight", 26),  # two rows of offset
    (_gptj, "transformer.rotary_emb.embed_positions", 24),  # a sin/cos table, gathered repeated
])
def test_a_learned_position_table_bounds_the_context(build, table, rows):
    model = build(24)
    verifier = dspark_compile(model)
    limit = verifier.position_limit
    assert (limit.positions, limit.table, limit.rows) == (24, table, rows)
    with pytest.raises(ValueError, match=rf"max_context=25 exceeds the 24 positions the "
                                         rf"model's position table {table} \({rows} rows\)"):
        verifier.new_state(max_requests=1, max_context=25)
    # a state of exactly that many tokens
    err = ragged_rounds_error(model, verifier, [0, 1], [10, 16], VOCAB, seed=1, rounds=3,
                              max_len=2, max_context=24)
    assert err < 1e-4, err


def test_rotary_positions_have_no_table():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=24)).eval()
    verifier = dspark_compile(model)
    assert verifier.position_limit is None
    verifier.new_state(max_requests=1, max_context=4096)


def test_the_limit_is_read_off_the_index_computation():
    """A table read at ``position % rows`` never runs out; one read at ``position + 5`` runs out
    five positions early; one read at token ids is not a position table."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from dspark_compile.graph_inputs import InputSpec, name_placeholders

    table = torch.randn(10, 4)

    def graphs(index):
        def f(ids, pos, weight):
            return torch.nn.functional.embedding(index(ids, pos), weight)
        gm = make_fx(f)(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                        table)
        name_placeholders(gm, [InputSpec("input_ids", "input_ids"),
                               InputSpec("positions", "positions"), InputSpec("param", "w")])
        for node, val in zip(gm.graph.find_nodes(op="placeholder"),
                             (torch.zeros(1, 3, dtype=torch.long),) * 2 + (table,)):
            node.meta["val"] = val
        return gm

    assert position_limit(graphs(lambda ids, pos: pos % 10)) is None
    assert position_limit(graphs(lambda ids, pos: pos + 5)).positions == 5
    assert position_limit(graphs(lambda ids, pos: ids)) is None
    repeated = position_limit(graphs(lambda ids, pos: pos.unsqueeze(-1).repeat(1, 1, 2) + 1))
    assert repeated.positions == 9  # each position read twice, one row on


def _gemma3n_with_a_short_per_layer_table(raw: bool):
    """A tiny Gemma 3n whose per-layer table has 100 rows under a 128-id embedding, its ids
    masked into it (as transformers 5.24 writes ``get_per_layer_inputs``) or indexed raw (5.17)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig
    from transformers.models.gemma3n import modeling_gemma3n as m

    torch.manual_seed(0)
    cfg = Gemma3nTextConfig(vocab_size=128, vocab_size_per_layer_input=100, hidden_size=64,
                            hidden_size_per_layer_input=16, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=256, laurel_rank=8,
                            num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
                            layer_types=["sliding_attention", "full_attention"],
                            sliding_window=4)
    model = Gemma3nForCausalLM(cfg).eval()

    def per_layer(self, input_ids):
        if not raw:
            input_ids = torch.where((input_ids >= 0) & (input_ids < 100), input_ids, 0)
        return self.embed_tokens_per_layer(input_ids).reshape(
            *input_ids.shape, self.config.num_hidden_layers, self.hidden_size_per_layer_input)
    return model, m.Gemma3nTextModel, per_layer


@pytest.mark.parametrize("raw", [False, True])
def test_a_second_token_table_bounds_the_ids_only_where_read_raw(monkeypatch, caplog, raw):
    """Ids the embedding accepts but a table indexed by the raw ids lacks are refused by name
    before anything runs (they would read out of bounds); ids masked into that table are not
    limited by it."""
    from dspark_compile import TokenIdError, VerifyLayout

    model, cls, per_layer = _gemma3n_with_a_short_per_layer_table(raw)
    monkeypatch.setattr(cls, "get_per_layer_inputs", per_layer)
    with caplog.at_level(logging.WARNING, logger="dspark_compile"):
        verifier = dspark_compile(model)
    assert verifier.vocab_size == (100 if raw else 128)
    assert ("limited to 0..99, the rows of" in caplog.text) == raw
    state = verifier.new_state(max_requests=1, max_context=16)
    layout = VerifyLayout.pack([3], [0], [0])
    ids = torch.tensor([5, 120, 7])
    if raw:
        with pytest.raises(TokenIdError, match=r"token id 120 .* outside the vocabulary 0..99"):
            verifier(ids, layout, state)
    else:
        got = verifier(ids, layout, state)
        with torch.no_grad():
            want = model(ids[None]).logits[0]
        assert (got - want).abs().max().item() < 1e-4
