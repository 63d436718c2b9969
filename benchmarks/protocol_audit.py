"""Misuse audit of the verify/commit protocol (issue 23): bad inputs and faults an engine
integrating the library could send, each classified by what the library did with it.

    python benchmarks/protocol_audit.py                       # this checkout
    python benchmarks/protocol_audit.py --before 16f1dac      # before/after table

Every probe runs a tiny random-weight HF Llama (float32, CPU) and ends in one of:

``refused``  a ``ValueError`` / ``TypeError`` (or a documented subclass: ``ProtocolError``,
             ``ConcurrentUseError``, ``StaleWeightsError``) whose message names what the probe
             expects (the argument or the cause), with the state unchanged where it checks that;
``safe``     accepted, and the result is what the documented conversion promises (checked);
``raw``      an exception of another kind, or one that does not name the argument or cause;
``silent``   accepted, and the state or the result is wrong (or a value was coerced silently).

``--before REV`` exports ``dspark_compile`` at ``REV`` (``git archive``, no checkout is touched)
into a temporary folder, runs the probes there and here in two subprocesses and prints one
table: per class, how many probes ended in each outcome before and after, then every probe.
``--json PATH`` writes this checkout's outcomes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter

import numpy as np
import torch

CLASSES = ("rewind", "commit not tied to its verify", "aliased buffers", "release coercions",
           "out-of-vocab ids", "swapped weights", "threads", "profile_sps on a live state",
           "silent coercions", "raw or misleading errors")
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=61, max_position_embeddings=256)
VOCAB = TINY["vocab_size"]
CLEAR = {"ValueError", "TypeError", "ProtocolError", "ConcurrentUseError", "StaleWeightsError",
         "TokenIdError"}
PROBES: list[tuple[str, str, object]] = []


def probe(cls: str, name: str):
    def register(fn):
        PROBES.append((cls, name, fn))
        return fn
    return register


class Silent(Exception):
    """Raised by a probe whose call was accepted but whose state or result is wrong."""


def model_and_verifier(seed: int = 0):
    from common import build_model
    from dspark_compile import dspark_compile

    model = build_model(TINY, device="cpu", dtype=torch.float32, seed=seed)
    return model, dspark_compile(model)


_SHARED: dict = {}


def shared():
    """One model and verifier for the probes that do not change them."""
    if not _SHARED:
        _SHARED["mv"] = model_and_verifier()
    return _SHARED["mv"]


def oracle(model, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(seq[None]).logits[0]


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def prefill(verifier, state, seqs: dict[int, torch.Tensor]):
    """Prefill and commit ``{slot: tokens}``."""
    from dspark_compile import VerifyLayout

    slots = sorted(seqs)
    layout = VerifyLayout.pack([seqs[s].numel() for s in slots], [0] * len(slots), slots)
    verifier(torch.cat([seqs[s] for s in slots]), layout, state)
    verifier.commit(layout, [seqs[s].numel() for s in slots], state)


def snapshot(state) -> list[torch.Tensor]:
    return [t.clone() for kv in state.kv_caches for t in kv] + [state.committed_lens.clone()]


def unchanged(state, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(snapshot(state), before))


def step_is_right(model, verifier, state, slot: int, seq: torch.Tensor, new: torch.Tensor) -> bool:
    """A verify of ``new`` over slot ``slot`` holding ``seq`` gives the oracle's logits."""
    from dspark_compile import VerifyLayout

    layout = VerifyLayout.pack([new.numel()], [seq.numel()], [slot])
    got = verifier(new, layout, state).clone()
    want = oracle(model, torch.cat([seq, new]))[seq.numel():]
    return torch.allclose(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------- rewind
@probe("rewind", "verify with context_lens below the committed length")
def _rewind():
    from dspark_compile import VerifyLayout

    model, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    seq = ids(8)
    prefill(verifier, state, {0: seq})
    before = snapshot(state)
    verifier(ids(3, 1), VerifyLayout.pack([3], [4], [0]), state)  # rewinds 4 committed rows
    if not unchanged(state, before) or not step_is_right(model, verifier, state, 0, seq, ids(2, 2)):
        raise Silent("committed KV rows overwritten; the slot's later steps are wrong")
    raise Silent("accepted (KV unchanged by luck)")


# ---------------------------------------------------------------- commit not tied to a verify
@probe("commit not tied to its verify", "commit with no verify before it")
def _commit_unverified():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    before = snapshot(state)
    verifier.commit(VerifyLayout.pack([4], [0], [0]), [4], state)
    if not unchanged(state, before):
        raise Silent("never-written KV made permanent (committed_lens advanced)")


@probe("commit not tied to its verify", "verify L1, verify L2, commit L1")
def _commit_stale():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    one, two = VerifyLayout.pack([4], [0], [0]), VerifyLayout.pack([2], [0], [0])
    verifier(ids(4), one, state)
    verifier(ids(2, 1), two, state)
    before = snapshot(state)
    verifier.commit(one, [4], state)
    if not unchanged(state, before):
        raise Silent("L2's rows committed as L1's (rows 2..3 were never verified by L2)")


@probe("commit not tied to its verify", "commit of a layout verified on another state")
def _commit_foreign():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    a = verifier.new_state(max_requests=2, max_context=32)
    b = verifier.new_state(max_requests=2, max_context=32)
    layout = VerifyLayout.pack([3], [0], [1])
    verifier(ids(3), layout, a)
    before = snapshot(b)
    verifier.commit(layout, [3], b)
    if not unchanged(b, before):
        raise Silent("foreign rows made permanent on the other state")


@probe("commit not tied to its verify", "unverified commit past max_context")
def _commit_past():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=16)
    before = snapshot(state)
    verifier.commit(VerifyLayout.pack([20], [0], [0]), [20], state)
    if not unchanged(state, before):
        raise Silent(f"committed_lens={state.committed_lens.tolist()} past max_context=16")


@probe("commit not tied to its verify", "the same step committed twice")
def _commit_twice():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    layout = VerifyLayout.pack([3], [0], [0])
    verifier(ids(3), layout, state)
    verifier.commit(layout, [3], state)
    before = snapshot(state)
    verifier.commit(layout, [3], state)
    if not unchanged(state, before):
        raise Silent("committed twice")


# ------------------------------------------------------------------------- aliased buffers
def _aliased(kind: str, bad: int):
    """Two requests of equal committed length; after ``pack`` the engine's slot buffer changes
    (slot 1 -> ``bad``), which passes every check made at call time today."""
    from dspark_compile import VerifyLayout

    model, verifier = shared()
    state = verifier.new_state(max_requests=3, max_context=32)
    seqs = {0: ids(5), 1: ids(5, 1), 2: ids(5, 3)}
    prefill(verifier, state, seqs)
    make = (lambda v: np.array(v, np.int32)) if kind == "numpy" else \
        (lambda v: torch.tensor(v, dtype=torch.int32))
    slots = make([0, 1])
    layout = VerifyLayout.pack([2, 2], make([5, 5]), slots)
    slots[1] = bad  # the engine reuses its buffer for the next batch
    new = ids(4, 2)
    before = snapshot(state)
    try:
        got = verifier(new, layout, state).clone()
    except (ValueError, TypeError):
        if unchanged(state, before):
            raise
        raise Silent("refused after writing")
    verifier.commit(layout, [2, 2], state)
    if state.committed_lens.tolist() != [7, 7, 5]:
        raise Silent(f"commit advanced committed_lens to {state.committed_lens.tolist()}")
    for s in (0, 1):
        if not step_is_right(model, verifier, state, s,
                             torch.cat([seqs[s], new[2 * s:2 * s + 2]]), ids(1, 5)):
            raise Silent(f"slot {s}'s KV is wrong after the buffer changed to {bad}")
    for i, s in enumerate((0, 1)):
        want = oracle(model, torch.cat([seqs[s], new[2 * i:2 * i + 2]]))[-2:]
        if not torch.allclose(got[2 * i:2 * i + 2], want, atol=1e-4, rtol=1e-4):
            raise Silent(f"slot {s}'s logits wrong after the buffer changed to {bad}")
    return "safe"


@probe("aliased buffers", "NumPy slots reused after pack: a duplicate slot")
def _alias_dup_np():
    return _aliased("numpy", 0)


@probe("aliased buffers", "NumPy slots reused after pack: slot -1")
def _alias_neg_np():
    return _aliased("numpy", -1)


@probe("aliased buffers", "int32 tensor slots reused after pack: a duplicate slot")
def _alias_dup_t():
    return _aliased("tensor", 0)


# ----------------------------------------------------------------------- release coercions
def _release(arg, expect_raise_only=False):
    _, verifier = shared()
    state = verifier.new_state(max_requests=4, max_context=32)
    prefill(verifier, state, {s: ids(3, s) for s in range(4)})
    before = snapshot(state)
    state.release(arg)
    if not unchanged(state, before):
        raise Silent(f"released live slots: committed_lens={state.committed_lens.tolist()}")


@probe("release coercions", "release(bool mask)")
def _rel_mask():
    _release(torch.tensor([True, False, False, False]))


@probe("release coercions", "release([-1])")
def _rel_neg():
    _release([-1])


@probe("release coercions", "release([1.7])")
def _rel_float():
    _release([1.7])


@probe("release coercions", "release([99])")
def _rel_range():
    _release([99])


# ------------------------------------------------------------------------- out-of-vocab ids
@probe("out-of-vocab ids", "verify with id = vocab")
def _oov_high():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    before = snapshot(state)
    bad = ids(4)
    bad[2] = VOCAB
    try:
        verifier(bad, VerifyLayout.pack([1, 3], [0, 0], [0, 1]), state)
    except Exception:
        if not unchanged(state, before):
            raise Silent("refused after writing KV")
        raise


@probe("out-of-vocab ids", "verify with id -1")
def _oov_neg():
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    bad = ids(4)
    bad[0] = -1
    verifier(bad, VerifyLayout.pack([4], [0], [1]), state)


def _engine(max_requests=2):
    from dspark_compile.engine.drafter import NoisyCopyDrafter
    from dspark_compile.engine.loop import EngineConfig, ReferenceEngine

    model, verifier = shared()
    return model, ReferenceEngine(verifier, NoisyCopyDrafter(model, noise=0.0),
                                  EngineConfig(mode="static", gamma=2, max_context=48),
                                  max_requests=max_requests)


def _greedy(model, prompt, n):
    seq = prompt.clone()
    for _ in range(n):
        seq = torch.cat([seq, oracle(model, seq)[-1].argmax().view(1)])
    return seq[prompt.numel():].tolist()


@probe("out-of-vocab ids", "ReferenceEngine: one bad prompt id among three requests")
def _engine_bad_prompt():
    model, engine = _engine()
    good = [ids(4, 7), ids(5, 8)]
    bad = ids(4, 9)
    bad[1] = VOCAB + 3
    rids = [engine.submit(good[0], 3)]
    try:
        engine.submit(bad, 3)
    except (ValueError, TypeError) as err:
        if str(VOCAB) not in str(err):
            raise RuntimeError(f"refused without naming the vocab: {err}") from err
        refused = err
    else:
        refused = None
    rids.append(engine.submit(good[1], 3))
    try:
        out = engine.run()
    except Exception as err:
        raise RuntimeError(f"run() raised {type(err).__name__}: {str(err)[:80]}; "
                           f"{len(engine.free_slots)} of 2 slots free") from err
    if [out.get(r) for r in rids] != [_greedy(model, g, 3) for g in good]:
        raise Silent(f"good requests lost or wrong: {out}")
    if refused is not None:
        raise refused
    return "safe"


@probe("out-of-vocab ids", "ReferenceEngine: a drafter proposing an out-of-vocab id")
def _engine_bad_draft():
    model, engine = _engine()

    class BadOnce:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def draft(self, seqs, gamma):
            d = self.inner.draft(seqs, gamma)
            self.calls += 1
            if self.calls == 2:  # second step: request 0's first draft is out of vocab
                d.tokens[0, 0] = VOCAB + 1
            return d

    engine.drafter = BadOnce(engine.drafter)
    prompts = [ids(4, 7), ids(5, 8), ids(3, 10)]
    rids = [engine.submit(p, 4) for p in prompts]
    try:
        out = engine.run()
    except Exception as err:
        raise RuntimeError(f"run() raised {type(err).__name__}: {str(err)[:80]}") from err
    failed = getattr(engine, "failed", {})
    served = [r for r in rids if r in out]
    if not failed or len(served) != 2 or any(
            out[r] != _greedy(model, p, 4) for r, p in zip(rids, prompts) if r in out):
        raise Silent(f"served {served}, failed {failed}")
    if len(engine.free_slots) != 2:
        raise Silent("slots leaked")
    return "safe"


@probe("out-of-vocab ids", "ReferenceEngine.submit(max_new_tokens=4.5)")
def _engine_float_tokens():
    _, engine = _engine()
    engine.submit(ids(4), 4.5)
    engine.run()
    raise Silent("accepted a float token budget")


# ------------------------------------------------------------------------- swapped weights
def _swapped(change):
    from dspark_compile import VerifyLayout

    model, verifier = model_and_verifier(seed=3)
    state = verifier.new_state(max_requests=2, max_context=32)
    seq = ids(5)
    layout = VerifyLayout.pack([5], [0], [0])
    verifier(seq, layout, state)
    change(model)
    got = verifier(seq, layout, state).clone()
    if not torch.allclose(got, oracle(model, seq), atol=1e-4, rtol=1e-4):
        raise Silent(f"served the old weights ({(got - oracle(model, seq)).abs().max():.2f} off)")
    return "safe"


@probe("swapped weights", "lm_head.weight = nn.Parameter(...)")
def _swap_param():
    def change(m):
        m.lm_head.weight = torch.nn.Parameter(torch.randn_like(m.lm_head.weight))
    _swapped(change)


@probe("swapped weights", "a decoder layer's MLP replaced")
def _swap_module():
    def change(m):
        old = m.model.layers[1].mlp
        new = type(old)(m.config)
        for p in new.parameters():
            torch.nn.init.normal_(p, std=0.5)
        m.model.layers[1].mlp = new
    _swapped(change)


@probe("swapped weights", "a later parameter's .data reassigned")
def _swap_data():
    def change(m):
        w = m.model.layers[1].self_attn.o_proj.weight
        w.data = torch.randn_like(w) * 0.5
    _swapped(change)


# --------------------------------------------------------------------------------- threads
@probe("threads", "two threads, disjoint slots of one captured state, 100 steps each")
def _threads():
    from dspark_compile import VerifyLayout

    model, verifier = shared()
    state = verifier.new_state(max_requests=4, max_context=32)
    verifier.capture(state, block=3, progress=False)
    seqs = {0: ids(4, 1), 2: ids(4, 2)}
    prefill(verifier, state, seqs)
    want = {s: oracle(model, torch.cat([seqs[s], ids(3, 10 + s)]))[-3:] for s in seqs}
    wrong, errors = [0], []

    def run(slot):
        layout = VerifyLayout.pack([3], [4], [slot])
        for _ in range(100):
            try:
                got = verifier(ids(3, 10 + slot), layout, state).clone()
            except Exception as err:  # noqa: BLE001 - counted
                errors.append(err)
                continue
            wrong[0] += not torch.allclose(got, want[slot], atol=1e-4, rtol=1e-4)

    threads = [threading.Thread(target=run, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    verifier.drop_session(state)
    if wrong[0]:
        raise Silent(f"{wrong[0]} of 200 results wrong, {len(errors)} errors")
    if errors:
        raise errors[0]
    return "safe"


# -------------------------------------------------------------------- profile_sps on live
@probe("profile_sps on a live state", "profile_sps over a state with a live request")
def _profile_live():
    from dspark_compile.runtime.profiler import profile_sps
    from dspark_compile.session.tiers import tier_set

    model, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=32)
    seq = ids(6)
    prefill(verifier, state, {0: seq})
    before = snapshot(state)
    profile_sps(verifier, state, context=2, tiers=tier_set(2, 2), block=2, warmup=1, iters=1,
                progress=False)
    if not unchanged(state, before):
        raise Silent("the live request's committed KV was overwritten")
    verifier.drop_session(state)
    if not step_is_right(model, verifier, state, 0, seq, ids(2, 3)):
        raise Silent("the live request's next step is wrong")
    return "safe"


# ----------------------------------------------------------------------- silent coercions
def _coerced(what: str):
    raise Silent(f"accepted: {what}")


@probe("silent coercions", "pack(lens=[True, 2])")
def _bool_lens():
    from dspark_compile import VerifyLayout

    VerifyLayout.pack([True, 2], [0, 0], [0, 1])
    _coerced("True as length 1")


@probe("silent coercions", "pack(slots=[True, 0])")
def _bool_slots():
    from dspark_compile import VerifyLayout

    VerifyLayout.pack([1, 2], [0, 0], [True, 0])
    _coerced("True as slot 1")


@probe("silent coercions", "new_state(page_size=0)")
def _page0():
    _, verifier = shared()
    s = verifier.new_state(max_requests=2, max_context=16, page_size=0)
    _coerced(f"page_size 0 -> {s.page_size}")


@probe("silent coercions", "SamplingParams.build(top_k=2.5)")
def _topk():
    from dspark_compile.engine import SamplingParams

    p = SamplingParams.build(0.5, top_k=2.5)
    _coerced(f"top_k 2.5 -> {p.top_k.tolist()}")


@probe("silent coercions", "SamplingParams.build(temperature=True)")
def _temp_true():
    from dspark_compile.engine import SamplingParams

    p = SamplingParams.build(True)
    _coerced(f"temperature True -> {p.temperature.tolist()}")


@probe("silent coercions", "EngineConfig(max_context=0)")
def _engine_ctx0():
    from dspark_compile.engine import EngineConfig

    EngineConfig(max_context=0)
    _coerced("max_context 0")


@probe("silent coercions", "TierRate over a zero-token tier")
def _tier_zero():
    from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable, TierRate

    TierRate(SpsTable(SpsMetadata("a", "b"), (SpsEntry(1, 100.0),)), [(0, 1)], 2)
    _coerced("tier (0, 1)")


@probe("silent coercions", "capture(tiers=())")
def _empty_tiers():
    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=16)
    verifier.capture(state, tiers=(), progress=False)
    _coerced("an empty tier set replaced by the default")


@probe("silent coercions", "a custom rate model returning NaN")
def _nan_rate():
    from dspark_compile.runtime import plan_verify

    class NanRate:
        def steps_per_second(self, tokens, requests):
            return torch.full(tokens.shape, float("nan"), dtype=torch.float64)

        def rate_span(self, first, count, requests):
            return torch.full((count,), float("nan"), dtype=torch.float64)

    plan = plan_verify(torch.full((3, 4), 0.9), NanRate())
    _coerced(f"NaN rates -> lens {plan.lens.tolist()} (speculation off)")


# -------------------------------------------------------------------- raw or misleading
def _commit_acc(acc):
    from dspark_compile import VerifyLayout

    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=16)
    layout = VerifyLayout.pack([2], [0], [0])
    verifier(ids(2), layout, state)
    verifier.commit(layout, acc, state)
    raise Silent(f"accept_lens={acc!r} accepted")


@probe("raw or misleading errors", "commit(accept_lens=None)")
def _acc_none():
    _commit_acc(None)


@probe("raw or misleading errors", "commit(accept_lens='ab')")
def _acc_str():
    _commit_acc("ab")


@probe("raw or misleading errors", "commit(accept_lens=meta tensor)")
def _acc_meta():
    _commit_acc(torch.ones(1, dtype=torch.int64, device="meta"))


@probe("raw or misleading errors", "commit(layout=dict)")
def _commit_dict():
    _, verifier = shared()
    state = verifier.new_state(max_requests=2, max_context=16)
    verifier.commit({"slots": [0]}, [1], state)


@probe("raw or misleading errors", "new_state(max_requests=True)")
def _state_true():
    _, verifier = shared()
    verifier.new_state(max_requests=True, max_context=16)
    _coerced("max_requests True")


@probe("raw or misleading errors", "new_state(max_context=2**40)")
def _state_huge():
    _, verifier = shared()
    verifier.new_state(max_requests=4, max_context=2 ** 40)


@probe("raw or misleading errors", "SamplingParams.build(np.float32(0.5))")
def _np_temp():
    from dspark_compile.engine import SamplingParams

    p = SamplingParams.build(np.float32(0.5), num_requests=2)
    if p.temperature.tolist() != [0.5, 0.5]:
        raise Silent(f"temperature {p.temperature.tolist()}")
    return "safe"


@probe("raw or misleading errors", "DSparkHook.plan(NumPy confidence)")
def _hook_np():
    from dspark_compile.engine import DSparkHook

    _, verifier = shared()
    hook = DSparkHook(verifier, max_requests=2, max_context=16, gamma=3)
    lens = hook.plan(np.full((2, 3), 0.5, np.float32))
    if list(lens) != [4, 4]:
        raise Silent(f"lens {list(lens)}")
    return "safe"


@probe("raw or misleading errors", "TierRate over a negative tier")
def _tier_neg():
    from dspark_compile.runtime import SpsEntry, SpsMetadata, SpsTable, TierRate

    TierRate(SpsTable(SpsMetadata("a", "b"), (SpsEntry(1, 100.0),)), [(-8, 2)], 2)
    _coerced("tier (-8, 2)")


@probe("raw or misleading errors", "a rate model whose rate_span is one short")
def _short_span():
    from dspark_compile.runtime import plan_verify

    class Short:
        def steps_per_second(self, tokens, requests):
            return torch.ones(tokens.shape, dtype=torch.float64)

        def rate_span(self, first, count, requests):
            return torch.ones(count - 1, dtype=torch.float64)

    plan_verify(torch.full((3, 4), 0.9), Short())
    _coerced("a short rate span")


@probe("raw or misleading errors", "a state made under torch.inference_mode")
def _inference_state():
    from dspark_compile import VerifyLayout

    model, verifier = shared()
    with torch.inference_mode():
        state = verifier.new_state(max_requests=2, max_context=16)
    seq = ids(3)
    layout = VerifyLayout.pack([3], [0], [0])
    verifier(seq, layout, state)
    verifier.commit(layout, [3], state)
    state.release([0])
    return "safe"


# --------------------------------------------------------------------------------- running
EXPECT = {  # words a clear refusal names (the argument or the cause), per probe
    "verify with context_lens below the committed length": ["context_lens", "committed"],
    "commit with no verify before it": ["verify"],
    "verify L1, verify L2, commit L1": ["verif"],
    "commit of a layout verified on another state": ["verif"],
    "unverified commit past max_context": ["verif"],
    "the same step committed twice": ["once"],
    "release(bool mask)": ["slots"], "release([-1])": ["slots"], "release([1.7])": ["slots"],
    "release([99])": ["max_requests"],
    "verify with id = vocab": ["vocab", "request"], "verify with id -1": ["vocab", "request"],
    "ReferenceEngine.submit(max_new_tokens=4.5)": ["max_new_tokens"],
    "lm_head.weight = nn.Parameter(...)": ["lm_head.weight"],
    "a decoder layer's MLP replaced": ["layers.1.mlp"],
    "a later parameter's .data reassigned": ["layers.1.self_attn.o_proj.weight"],
    "two threads, disjoint slots of one captured state, 100 steps each": ["thread"],
    "profile_sps over a state with a live request": ["live"],
    "pack(lens=[True, 2])": ["lens"], "pack(slots=[True, 0])": ["slots"],
    "new_state(page_size=0)": ["page_size"], "SamplingParams.build(top_k=2.5)": ["top_k"],
    "SamplingParams.build(temperature=True)": ["temperature"],
    "EngineConfig(max_context=0)": ["max_context"],
    "TierRate over a zero-token tier": ["tier"], "capture(tiers=())": ["tiers"],
    "a custom rate model returning NaN": ["rate"],
    "commit(accept_lens=None)": ["accept_lens"], "commit(accept_lens='ab')": ["accept_lens"],
    "commit(accept_lens=meta tensor)": ["accept_lens"], "commit(layout=dict)": ["layout"],
    "new_state(max_requests=True)": ["max_requests"],
    "new_state(max_context=2**40)": ["max_context"],
    "TierRate over a negative tier": ["tier"],
    "a rate model whose rate_span is one short": ["rate_span"],
    # probes whose fix is a documented conversion: any exception is a raw one
    "NumPy slots reused after pack: a duplicate slot": ["slots", "buffer"],
    "NumPy slots reused after pack: slot -1": ["slots", "buffer"],
    "int32 tensor slots reused after pack: a duplicate slot": ["slots", "buffer"],
    "SamplingParams.build(np.float32(0.5))": ["temperature", "np.float32"],
    "DSparkHook.plan(NumPy confidence)": ["confidence", "numpy"],
    "a state made under torch.inference_mode": ["inference", "new_state"],
    "ReferenceEngine: one bad prompt id among three requests": ["vocab", "prompt"],
    "ReferenceEngine: a drafter proposing an out-of-vocab id": ["vocab", "request"],
}


def run_probes() -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for cls, name, fn in PROBES:
        try:
            out = fn()
            outcome, detail = (out, "") if out == "safe" else ("silent", "accepted")
        except Silent as err:
            outcome, detail = "silent", str(err)
        except Exception as err:  # noqa: BLE001 - classifying is the point
            kind = type(err).__name__
            named = all(w.lower() in str(err).lower() for w in EXPECT.get(name, []))
            outcome = "refused" if kind in CLEAR and named else "raw"
            detail = f"{kind}: {' '.join(str(err).split())[:110]}"
        rows.append({"class": cls, "probe": name, "outcome": outcome, "detail": detail})
    return rows


def _run_tree(path: str | None) -> list[dict]:
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path or os.path.dirname(here), here) if p)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--json", f.name], env=env,
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(f)


def table(before: list[dict] | None, after: list[dict]) -> str:
    def counts(rows, cls):
        c = Counter(r["outcome"] for r in rows if r["class"] == cls)
        return " ".join(f"{c[k]} {k}" for k in ("silent", "raw", "refused", "safe") if c[k]) or "-"

    head = ["class", "probes"] + (["before"] if before else []) + ["after"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cls in CLASSES:
        n = sum(r["class"] == cls for r in after)
        cells = [cls, str(n)] + ([counts(before, cls)] if before else []) + [counts(after, cls)]
        lines.append("| " + " | ".join(cells) + " |")
    total = ["all", str(len(after))] + [
        " ".join(f"{c[k]} {k}" for k in ("silent", "raw", "refused", "safe") if c[k])
        for c in ([Counter(r["outcome"] for r in before)] if before else []) +
        [Counter(r["outcome"] for r in after)]]
    lines.append("| " + " | ".join(total) + " |")
    lines.append("")
    old = {r["probe"]: r for r in before or []}
    for r in after:
        was = old.get(r["probe"])
        lines.append(f"- [{r['class']}] {r['probe']}: " +
                     (f"{was['outcome']} -> " if was else "") + f"{r['outcome']}" +
                     (f"  ({r['detail']})" if r["detail"] else ""))
        if was and was["detail"]:
            lines.append(f"      before: {was['detail']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="git revision to compare against (git archive)")
    parser.add_argument("--json", help="write this checkout's outcomes here and stop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.json:
        rows = run_probes()
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        return
    before = None
    if args.before:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True,
                              capture_output=True, text=True).stdout.strip()
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(["git", "-C", root, "archive", args.before,
                                      "dspark_compile"], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            before = _run_tree(tmp)
    after = _run_tree(None)
    print(table(before, after))


if __name__ == "__main__":
    main()
