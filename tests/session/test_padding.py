"""Padding cannot leak: NaN/Inf in dense padding positions or unused pool pages changes no
real logit."""

import torch

from dspark_compile import VerifyLayout, dspark_compile
from helpers import tiny_llama

POISON = 0  # token id whose embedding row is NaN


def poisoned_llama():
    model = tiny_llama(seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight[POISON] = float("nan")
    return model


def prefill(verifier, state, prompts, slots):
    layout = VerifyLayout.pack([len(p) for p in prompts], [0] * len(prompts), slots)
    verifier(torch.cat(prompts), layout, state)
    verifier.commit(layout, [len(p) for p in prompts], state)


def tokens(n, gen):
    return torch.randint(1, 97, (n,), generator=gen)  # never the poison id


def test_nan_in_dense_padding_positions_leaves_real_rows_equal():
    model = poisoned_llama()
    verifier = dspark_compile(model)
    gen = torch.Generator().manual_seed(0)
    slots, lens = [2, 0, 1], [3, 1, 5]
    prompts = [tokens(n, gen) for n in (4, 7, 2)]
    new = [tokens(n, gen) for n in lens]
    t = max(lens)

    ragged_state = verifier.new_state(max_requests=3, max_context=32)
    prefill(verifier, ragged_state, prompts, slots)
    context = [len(p) for p in prompts]
    layout = VerifyLayout.pack(lens, context, slots)
    ragged = verifier(torch.cat(new), layout, ragged_state)

    dense_state = verifier.new_state(max_requests=3, max_context=32)
    prefill(verifier, dense_state, prompts, slots)
    padded = torch.full((len(lens), t), POISON, dtype=torch.int64)
    for i, row in enumerate(new):
        padded[i, :len(row)] = row
    dense = verifier.run_dense(padded, context, slots, dense_state)

    assert torch.isnan(dense[0, lens[0]:]).all()  # the padding really is poisoned
    qsl = layout.query_start_loc.tolist()
    for i, n in enumerate(lens):
        torch.testing.assert_close(ragged[qsl[i]:qsl[i + 1]], dense[i, :n], atol=1e-5, rtol=0)
        assert torch.isfinite(dense[i, :n]).all()


def test_nan_in_unused_pool_pages_leaves_logits_bitwise_equal():
    model = tiny_llama(seed=4)
    verifier = dspark_compile(model)
    gen = torch.Generator().manual_seed(1)
    slots = [3, 1]
    prompts = [tokens(6, gen), tokens(9, gen)]
    lens = [4, 2]
    new = torch.cat([tokens(n, gen) for n in lens])

    def run(poison: bool):
        state = verifier.new_state(max_requests=5, max_context=48)
        if poison:  # everything is garbage to begin with ...
            for k, v in state.kv_caches:
                k.fill_(float("nan"))
                v.fill_(float("inf"))
        prefill(verifier, state, prompts, slots)
        layout = VerifyLayout.pack(lens, [6, 9], slots)
        return verifier(new, layout, state), state

    clean, _ = run(False)
    dirty, state = run(True)
    # ... and still is outside what was written: pages of other slots, rows past each sequence.
    assert torch.isnan(state.kv_caches[0][0]).any()
    assert torch.equal(clean, dirty)
