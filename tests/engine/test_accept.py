"""Accept step: the Triton kernels against the torch reference, and the semantics of both.

Kernel tests run under ``TRITON_INTERPRET=1`` on CPU tensors (``make test`` and the conftest set
it before any kernel is imported) or on a GPU; the reference and statistical tests need neither.
The interpreter costs ~12 ms per greedy or unfiltered row and ~0.1-0.4 s per row with top-k and
top-p (two threshold searches), so those cases keep V and the row count small.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dspark_compile.engine import (AcceptResult, PhiloxNoise, PreDrawnNoise, SamplingParams,
                                   accept, accept_reference, draw_philox_noise, emitted_tokens,
                                   philox4x32)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(not INTERPRET and not HAS_CUDA,
                                  reason="needs TRITON_INTERPRET=1 (set before import) or a GPU")
DEVICE = "cpu" if INTERPRET or not HAS_CUDA else "cuda"


def packed(lens) -> torch.Tensor:
    """``query_start_loc`` (int32) of verify lengths ``lens``."""
    return torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)


def gumbel_like(shape, gen) -> torch.Tensor:
    return -torch.log(-torch.log(torch.rand(shape, generator=gen).clamp(1e-9, 1 - 1e-7)))


def make_case(lens, vocab, configs, seed=0, ties=False, num_pad=0, dtype=torch.float32):
    """Random verify step. ``configs[i] = (temperature, top_k, top_p)`` of request ``i``.

    The drafter's ``q`` for the draft at input row ``n + 1`` is target row ``n`` perturbed (with
    its temperature and top-k) and the draft is drawn from it (greedy requests: the target's
    argmax 3 times in 4), so drafts are often accepted. Padding rows hold NaN.
    """
    g = torch.Generator().manual_seed(seed)
    qsl = packed(lens)
    n = int(qsl[-1]) + num_pad
    logits = torch.randn(n, vocab, generator=g) * 2
    if ties:
        logits = (logits * 2).round() / 2  # many equal logits: exercises every tie rule
    logits[int(qsl[-1]):] = float("nan")
    q = torch.zeros(n, vocab)
    ids = torch.randint(0, vocab, (n,), generator=g)
    for i, (t, k, _) in enumerate(configs):
        for row in range(int(qsl[i]), int(qsl[i + 1]) - 1):
            qz = (logits[row] + torch.randn(vocab, generator=g) * 0.3) / (t or 1.0)
            if 0 < k < vocab:
                qz[logits[row] < torch.topk(logits[row], k).values[-1]] = float("-inf")
            q[row + 1] = torch.softmax(qz, -1)
            if t > 0:
                ids[row + 1] = torch.multinomial(q[row + 1], 1, generator=g)[0]
            elif torch.rand((), generator=g) < 0.75:
                ids[row + 1] = int(torch.argmax(logits[row]))
    sampling = SamplingParams.build(*map(list, zip(*configs)))
    noise = PreDrawnNoise(torch.rand(n, generator=g), gumbel_like((len(lens), vocab), g))
    return logits.to(dtype), ids, qsl, sampling, noise, q


def to_device(*xs):
    """Tensors and noise / sampling dataclasses moved to DEVICE; None stays None."""
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            out.append(x.to(DEVICE))
        elif x is None:
            out.append(None)
        else:
            out.append(type(x)(*(t.to(DEVICE) for t in vars(x).values())))
    return out


def assert_same(got: AcceptResult, want: AcceptResult) -> None:
    for name, a, b in zip(AcceptResult._fields, got, want):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: kernel {a.tolist()} != ref {b.tolist()}"


G, S1, S2 = (0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 0.8)  # greedy; plain sample; both filters
CASES = {  # name: (lens, vocab, configs, options)
    "v1": ([1, 3, 2], 1, [G, S1, S2], {}),
    "v7_r5_mixed": ([1, 8, 3, 2, 5], 7, [S1, G, (1.3, 3, 1.0), (0.5, 0, 0.6), S2], {}),
    "v7_ties": ([4, 6, 2], 7, [(1.0, 2, 1.0), G, (0.9, 0, 0.55)], {"ties": True}),
    "v7_padding": ([3, 2], 7, [S2, G], {"num_pad": 3}),
    "v33_bf16": ([5, 2], 33, [(1.1, 6, 0.9), G], {"dtype": torch.bfloat16}),
    "v33_fp16_ties": ([4], 33, [(0.8, 0, 0.7)], {"dtype": torch.float16, "ties": True}),
    "v1000": ([4, 2, 3], 1000, [(0.7, 50, 1.0), G, (1.0, 0, 0.9)], {}),
    "v1000_topk_topp": ([2], 1000, [(1.2, 40, 0.85)], {}),
    "v4099": ([2, 3, 1], 4099, [(0.9, 100, 0.95), G, S1], {}),
}


# one-hot drafts at V >= 1000 would add interpreter time and no new path
KERNEL_CASES = [(name, with_q) for name in sorted(CASES) for with_q in (True, False)
                if with_q or CASES[name][1] < 1000]


@needs_triton
@pytest.mark.parametrize("name,with_q", KERNEL_CASES,
                         ids=[f"{n}-{'draft_probs' if q else 'one_hot'}" for n, q in KERNEL_CASES])
def test_kernel_matches_reference(name, with_q):
    lens, vocab, configs, options = CASES[name]
    logits, ids, qsl, sampling, noise, q = make_case(lens, vocab, configs, **options)
    args = to_device(logits, ids, qsl, sampling, noise, q if with_q else None)
    want = accept_reference(*args)
    assert_same(accept(*args), want)
    lens_out = want.accept_lens.cpu()
    assert (lens_out >= 1).all() and (lens_out <= torch.tensor(lens)).all()


@needs_triton
@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot_drafts"])
def test_kernel_philox_stream_matches_reference(with_q):
    lens, configs = [3, 1, 4, 2], [S1, S2, (1.4, 0, 0.9), G]
    logits, ids, qsl, sampling, _, q = make_case(lens, 19, configs, seed=3)
    noise = PhiloxNoise(torch.tensor([7, -1, 2 ** 40 + 5, 0]), torch.tensor([0, 3, 2 ** 33, 9]))
    args = to_device(logits, ids, qsl, sampling, noise, q if with_q else None)
    assert_same(accept(*args), accept_reference(*args))


def test_philox_matches_random123_known_answers():
    """Random123's kat_vectors for philox4x32-10; the key is ``k1 << 32 | k0``."""
    kat = [(0, (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           (2 ** 64 - 1, (2 ** 32 - 1,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           (0x299F31D0A4093822, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for key, counter, want in kat:
        seed = torch.tensor(key - 2 ** 64 if key >= 2 ** 63 else key)  # as int64 holds it
        got = philox4x32(seed, [torch.tensor(c) for c in counter])
        assert [int(w) for w in got] == list(want)


def test_philox_noise_is_uniform_and_keyed_by_seed_and_step():
    qsl, r, v = packed([4] * 500), 500, 64
    noise = PhiloxNoise(torch.arange(r) * 1000003, torch.full((r,), 12))
    drawn = draw_philox_noise(noise, qsl, 2000, v)
    u = drawn.uniforms
    assert ((u > 0) & (u < 1)).all()
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert chi2_pvalue(counts, torch.full((10,), 0.1)) > 1e-4
    gumbel_mean = drawn.gumbel.mean().item()  # Euler-Mascheroni: 0.5772
    assert abs(gumbel_mean - 0.5772) < 0.02
    again = draw_philox_noise(noise, qsl, 2000, v)
    assert torch.equal(again.uniforms, u) and torch.equal(again.gumbel, drawn.gumbel)
    stepped = draw_philox_noise(PhiloxNoise(noise.seeds, noise.steps + 1), qsl, 2000, v)
    assert (stepped.uniforms != u).float().mean() > 0.99


def greedy_prefix(logits, ids, qsl):
    """(accepted, token) per request by plain argmax matching, computed independently."""
    out = []
    for i in range(len(qsl) - 1):
        rows = logits[qsl[i]:qsl[i + 1]].float().nan_to_num(float("-inf"), float("inf"))
        best = [int(torch.argmax(r)) for r in rows]
        j = 0
        while j + 1 < len(best) and int(ids[qsl[i] + j + 1]) == best[j]:
            j += 1
        out.append((j, best[j]))
    return out


@pytest.mark.parametrize("impl", ["reference", pytest.param("kernel", marks=needs_triton)])
@pytest.mark.parametrize("ties", [False, True])
def test_greedy_accepts_exactly_the_argmax_prefix(impl, ties):
    lens = [1, 5, 3, 8, 2]
    logits, ids, qsl, sampling, noise, _ = make_case(lens, 11, [G] * 5, seed=5, ties=ties)
    fn = accept_reference if impl == "reference" else accept
    res = fn(*to_device(logits, ids, qsl, sampling, noise))
    want = greedy_prefix(logits, ids, qsl.tolist())
    assert res.num_accepted_drafts.tolist() == [j for j, _ in want]
    assert res.accept_lens.tolist() == [j + 1 for j, _ in want]
    assert res.next_tokens.tolist() == [t for _, t in want]
    assert 0 < sum(j for j, _ in want) < sum(lens) - len(lens)  # some accepted, some rejected


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (0 if off the support)."""
    counts, probs = counts.double(), probs.double()
    if (counts[probs == 0] > 0).any():
        return 0.0
    n, support = counts.sum(), probs > 0
    stat = ((counts - n * probs)[support] ** 2 / (n * probs[support])).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


def expected_probs(logits, temperature, top_k, top_p):
    """Target distribution by the rules, with Python floats and a sort (distinct logits)."""
    z = [float(x) for x in logits]
    order = sorted(range(len(z)), key=lambda v: -z[v])
    kept = order[:top_k] if 0 < top_k < len(z) else order
    e = {v: math.exp((z[v] - z[order[0]]) / temperature) for v in kept}
    total, mass, chosen = sum(e.values()), 0.0, []
    for v in kept:
        if top_p < 1 and mass >= top_p * total:
            break
        chosen.append(v)
        mass += e[v]
    p = torch.zeros(len(z), dtype=torch.float64)
    for v in chosen:
        p[v] = e[v] / sum(e[c] for c in chosen)
    return p


TARGET = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]).log()
DRAFT = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])


def sample_round(r, length, configs, with_q, noise_seed, philox=False):
    """``r`` requests of ``length`` identical rows; drafts i.i.d. from DRAFT."""
    g = torch.Generator().manual_seed(noise_seed)
    qsl, n, v = packed([length] * r), r * length, len(TARGET)
    ids = torch.multinomial(DRAFT, n, replacement=True, generator=g)
    sampling = SamplingParams.build(*map(list, zip(*([configs] * r))))
    if philox:
        noise = PhiloxNoise(torch.arange(r) + noise_seed * r, torch.full((r,), noise_seed))
    else:
        noise = PreDrawnNoise(torch.rand(n, generator=g), gumbel_like((r, v), g))
    return TARGET.repeat(n, 1), ids, qsl, sampling, noise, DRAFT.repeat(n, 1) if with_q else None


STAT_CASES = [(config, with_q, False) for config in
              [(1.0, 0, 1.0), (0.6, 4, 1.0), (1.3, 0, 0.7), (0.8, 5, 0.8)]
              for with_q in (True, False)] + [((0.8, 5, 0.8), True, True)]


@pytest.mark.parametrize("config,with_q,philox", STAT_CASES)
def test_rejection_sampling_preserves_the_target_distribution(config, with_q, philox):
    """Every emitted token follows the filtered target, and drafts are accepted at the optimal
    rate: ``sum(min(p, q))`` (``sum(q * p)`` when ``q`` is declared one-hot)."""
    r = 1500
    args = sample_round(r, 3, config, with_q, noise_seed=11, philox=philox)
    res = accept_reference(*args)
    tokens = emitted_tokens(args[1], args[2], res)
    want = expected_probs(TARGET, *config)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=6)
    every = torch.bincount(torch.tensor([x for t in tokens for x in t]), minlength=6)
    assert chi2_pvalue(first, want) > 1e-4 and chi2_pvalue(every, want) > 1e-4
    drafts = torch.bincount(args[1][1::3], minlength=6)  # the test can fail: q is not p
    assert chi2_pvalue(drafts, want) < 1e-4
    rate = (torch.minimum(want, DRAFT.double()) if with_q else want * DRAFT).sum().item()
    first_accepted = (res.num_accepted_drafts >= 1).double().mean().item()
    assert abs(first_accepted - rate) < 4 * math.sqrt(rate * (1 - rate) / r)


@needs_triton
def test_in_kernel_rng_preserves_the_target_distribution():
    """The Philox path of the kernel itself: a smoke-level sample (~100 tokens; each row draws
    ~100 integer ops of Philox, slow under the interpreter). The strong evidence is the bitwise
    match with the reference on this path and the reference's tests above at 1500 requests."""
    tokens = []
    for step in range(2):
        args = to_device(*sample_round(20, 3, (1.0, 0, 1.0), True, noise_seed=step, philox=True))
        tokens += emitted_tokens(args[1], args[2], accept(*args))
    want = expected_probs(TARGET, 1.0, 0, 1.0)
    assert chi2_pvalue(torch.bincount(torch.tensor([x for t in tokens for x in t]),
                                      minlength=6), want) > 1e-4


class ToyLM:
    """Deterministic next-token logits from the last two tokens (integer logits: ties)."""

    def __init__(self, vocab, seed, scale):
        g = torch.Generator().manual_seed(seed)
        self.a = (torch.randn(vocab, vocab, generator=g) * scale).round()
        self.b = (torch.randn(vocab, vocab, generator=g) * scale).round()

    def __call__(self, ctx):
        return self.a[ctx[-1]] + self.b[ctx[-2] if len(ctx) > 1 else 0]


@pytest.mark.parametrize("impl", ["reference", pytest.param("kernel", marks=needs_triton)])
def test_greedy_speculative_decoding_is_lossless(impl):
    vocab, new_tokens, prompts = 16, 12, [[1, 2], [5], [7, 7, 3]]
    target, drafter = ToyLM(vocab, 0, 2.0), ToyLM(vocab, 0, 2.0)
    drafter.b = drafter.b + (torch.rand(vocab, vocab, generator=torch.Generator().manual_seed(1))
                             < 0.3) * 3.0  # the drafter is wrong sometimes
    plain = []
    for p in prompts:
        ctx = list(p)
        while len(ctx) < len(p) + new_tokens:
            ctx.append(int(torch.argmax(target(ctx))))
        plain.append(ctx[len(p):])
    fn, rng, ctxs = (accept_reference if impl == "reference" else accept), random.Random(0), \
        [list(p) for p in prompts]
    while min(len(c) - len(p) for c, p in zip(ctxs, prompts)) < new_tokens:
        rows, ids, lens = [], [], []
        for ctx in ctxs:
            drafts = []
            for _ in range(rng.randint(0, 4)):
                drafts.append(int(torch.argmax(drafter(ctx + drafts))))
            rows += [target(ctx + drafts[:j]) for j in range(len(drafts) + 1)]
            ids += [ctx[-1]] + drafts
            lens.append(len(drafts) + 1)
        res = fn(*to_device(torch.stack(rows), torch.tensor(ids), packed(lens),
                            SamplingParams.build([0.0] * 3), PreDrawnNoise(
                                torch.rand(len(ids)), torch.zeros(3, vocab))))
        for ctx, out in zip(ctxs, emitted_tokens(torch.tensor(ids), packed(lens), res)):
            ctx += out
    assert [c[len(p):len(p) + new_tokens] for c, p in zip(ctxs, prompts)] == plain


# +inf logits become float32 max: (z - m) / T overflows to -inf for the others, as intended
OVERFLOW_OK = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")


def nonfinite_case():
    """Rows: all NaN, all -inf, NaN among finite, two +inf, finite. One request per row kind."""
    v, nan, inf = 9, float("nan"), float("inf")
    rows = torch.randn(10, v, generator=torch.Generator().manual_seed(2))
    rows[0:2] = nan
    rows[2:4] = -inf
    rows[4:6, ::2] = nan
    rows[6:8, [3, 6]] = inf
    return rows, [2, 2, 2, 2, 2]


@OVERFLOW_OK
@pytest.mark.parametrize("impl", ["reference", pytest.param("kernel", marks=needs_triton)])
@pytest.mark.parametrize("config", [G, S1, S2, (0.9, 1, 1.0)])
def test_non_finite_rows_give_defined_in_vocab_tokens(impl, config):
    logits, lens = nonfinite_case()
    ids = torch.tensor([0, 0, 0, 0, 0, 1, 0, 3, 0, 2])
    q = torch.full((10, 9), 1 / 9)
    q[5, 1] = float("nan")  # NaN q counts as 0: accepted whenever p > 0
    noise = PreDrawnNoise(torch.full((10,), 0.5), torch.zeros(5, 9))
    fn = accept_reference if impl == "reference" else accept
    res = fn(*to_device(logits, ids, packed(lens), SamplingParams.build(*[[c] * 5 for c in config]),
                        noise, q))
    acc, tok = res.num_accepted_drafts.tolist(), res.next_tokens.tolist()
    assert all(0 <= t < 9 for t in tok)
    assert tok[0] == 0 and tok[1] == 0  # all NaN / all -inf: token 0 (greedy: after draft 0)
    assert acc[:2] == ([1, 1] if config == G else [0, 0])  # sampled: p is 0 everywhere
    assert tok[2] % 2 == 1  # NaN logits never win
    assert tok[3] in (3, 6)  # +inf logits share the mass (greedy: the first, 3)
    if impl == "kernel":
        assert_same(res, accept_reference(*to_device(
            logits, ids, packed(lens), SamplingParams.build(*[[c] * 5 for c in config]), noise, q)))


@pytest.mark.parametrize("impl", ["reference", pytest.param("kernel", marks=needs_triton)])
def test_out_of_range_drafts_are_rejected_and_empty_requests_are_defined(impl):
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(4))
    logits[6] = float("nan")  # padding row
    qsl = torch.tensor([0, 3, 3, 6], dtype=torch.int32)  # request 1 has no row
    ids = torch.tensor([0, int(torch.argmax(logits[0])), -1, 0, 5, 2, 1])
    fn = accept_reference if impl == "reference" else accept
    for config in (G, S1):
        res = fn(*to_device(logits, ids, qsl, SamplingParams.build(*[[c] * 3 for c in config]),
                            PreDrawnNoise(torch.zeros(7), torch.zeros(3, 5))))
        assert res.num_accepted_drafts.tolist()[1:] == [0, 0]  # id -1 / 5: rejected
        assert res.accept_lens.tolist()[1] == 0 and res.next_tokens.tolist()[1] == 0
        assert 0 <= res.next_tokens[2] < 5


def test_padding_rows_and_batch_neighbours_do_not_change_a_request():
    logits, ids, qsl, sampling, noise, q = make_case([3, 4, 2], 13, [S2, G, S1], seed=9)
    whole = accept_reference(logits, ids, qsl, sampling, noise, q)
    lo, hi = int(qsl[1]), int(qsl[2])
    alone = accept_reference(logits[lo:hi], ids[lo:hi], packed([hi - lo]),
                             SamplingParams.build([0.0]), PreDrawnNoise(
                                 noise.uniforms[lo:hi], noise.gumbel[1:2]), q[lo:hi])
    assert [t[1].item() for t in whole] == [t[0].item() for t in alone]


@needs_triton
def test_same_seed_and_step_give_the_same_tokens_and_another_step_differs():
    logits, ids, qsl, sampling, _, q = make_case([2] * 4, 101, [S1] * 4, seed=6)
    seeds = torch.arange(4) * 31

    def run(step):
        return accept(*to_device(logits, ids, qsl, sampling,
                                 PhiloxNoise(seeds, torch.full((4,), step)), q))

    first = run(4)
    assert_same(run(4), first)
    assert not torch.equal(run(5).next_tokens, first.next_tokens)


def draw_rows(data, max_requests, max_len):
    """Arbitrary small steps: logits with NaN and +-inf, draft ids off the vocabulary too."""
    r = data.draw(st.integers(1, max_requests))
    lens = data.draw(st.lists(st.integers(1, max_len), min_size=r, max_size=r))
    v, n = data.draw(st.integers(1, 9)), sum(lens)
    values = st.sampled_from([0.0, 1.0, -1.0, 2.5, float("nan"), float("inf"), float("-inf")])
    logits = torch.tensor(data.draw(st.lists(values, min_size=n * v, max_size=n * v))).view(n, v)
    ids = torch.tensor(data.draw(st.lists(st.integers(-1, v), min_size=n, max_size=n)))
    sampling = SamplingParams.build(
        data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=r, max_size=r)),
        data.draw(st.lists(st.integers(0, v + 1), min_size=r, max_size=r)),
        data.draw(st.lists(st.sampled_from([0.3, 0.9, 1.0]), min_size=r, max_size=r)))
    noise = PhiloxNoise(torch.arange(r), torch.full((r,), data.draw(st.integers(0, 2 ** 40))))
    return lens, (logits, ids, packed(lens), sampling, noise)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reference_invariants_on_arbitrary_rows(data):
    """Any logits, any controls: lengths in range and tokens in the vocabulary."""
    lens, args = draw_rows(data, 4, 5)
    res = accept_reference(*args)
    assert ((res.next_tokens >= 0) & (res.next_tokens < args[0].shape[1])).all()
    assert ((res.accept_lens >= 1) & (res.accept_lens <= torch.tensor(lens))).all()
    assert torch.equal(res.accept_lens, res.num_accepted_drafts + 1)


@needs_triton
@OVERFLOW_OK
@settings(max_examples=10, deadline=None)  # ~0.3 s an example under the interpreter
@given(st.data())
def test_kernel_matches_reference_on_arbitrary_rows(data):
    _, args = draw_rows(data, 2, 3)
    args = to_device(*args)
    assert_same(accept(*args), accept_reference(*args))


def bad_inputs(device):
    """A valid call, and (overrides, message pattern, checked only on the host) cases."""
    n, v, r = 5, 7, 2

    def t(*args, **kw):
        return torch.tensor(*args, **kw).to(device)

    sp = SamplingParams.build([0.0, 1.0], device=device)
    good = dict(target_logits=torch.randn(n, v, device=device),
                input_ids=torch.zeros(n, dtype=torch.int64, device=device),
                query_start_loc=packed([3, 2]).to(device), sampling=sp,
                noise=PreDrawnNoise(torch.rand(n, device=device), torch.zeros(r, v, device=device)),
                draft_probs=None)
    ids = good["input_ids"]
    return good, [
        (dict(target_logits=good["target_logits"].view(-1)), "2-D", False),
        (dict(target_logits=ids.view(n, 1).expand(n, v).int()), "target_logits has dtype", False),
        (dict(target_logits=torch.randn(v, n, device=device).t()), "dense last dim", False),
        (dict(input_ids=t([0] * (n + 1))), "input_ids", False),
        (dict(input_ids=ids.float()), "input_ids has dtype", False),
        (dict(input_ids=torch.zeros(n, dtype=torch.int64, device="meta")), "is on meta", False),
        (dict(input_ids=torch.zeros(2 * n, dtype=torch.int64, device=device)[::2]),
         "pass .contiguous()", False),
        (dict(sampling=SamplingParams.build([0.0] * 3, device=device)),
         "sampling.temperature has 3", False),
        (dict(noise=PreDrawnNoise(good["noise"].uniforms, torch.zeros(r, v + 1, device=device))),
         "noise.gumbel", False),
        (dict(noise=PhiloxNoise(t([0, 0], dtype=torch.int32), t([0, 0]))),
         "noise.seeds has dtype", False),
        (dict(noise=(good["noise"].uniforms, good["noise"].gumbel)),
         "PreDrawnNoise or PhiloxNoise", False),
        (dict(draft_probs=torch.rand(n, v + 1, device=device)), "draft_probs", False),
        # values: free to check on the host; on a GPU they are checked where they are built
        (dict(query_start_loc=t([0, 3, 2], dtype=torch.int32)), "never decrease", True),
        (dict(query_start_loc=t([1, 3, 5], dtype=torch.int32)), "start at 0", True),
        (dict(query_start_loc=t([0, 3, 6], dtype=torch.int32)), "end <= N=5", True),
        (dict(sampling=SamplingParams(sp.temperature, t([0, -1], dtype=torch.int32), sp.top_p)),
         r"top_k\[1\]=-1", True),
        (dict(sampling=SamplingParams(sp.temperature, sp.top_k, t([1.0, 0.0]))),
         r"top_p\[1\]=0.0; it must be in \(0, 1\]", True),
        (dict(sampling=SamplingParams(sp.temperature, sp.top_k, t([1.5, 1.0]))),
         r"top_p\[0\]=1.5", True),
        (dict(sampling=SamplingParams(t([-1.0, 1.0]), sp.top_k, sp.top_p)),
         r"temperature\[0\]=-1.0; it must be finite and >= 0", True),
    ]


@pytest.mark.parametrize("impl", ["reference", pytest.param("kernel", marks=needs_triton)])
def test_bad_inputs_raise_value_errors_naming_the_rule(impl):
    device = "cpu" if impl == "reference" else DEVICE
    good, cases = bad_inputs(device)
    fn = accept_reference if impl == "reference" else accept
    fn(**good)  # the baseline is valid
    for override, pattern, host_only in cases:
        if host_only and device != "cpu":
            continue
        with pytest.raises(ValueError, match=pattern):
            fn(**{**good, **override})


def test_sampling_params_build_checks_host_values():
    sp = SamplingParams.build(0.7, [0, 5, 3], 0.9)
    assert sp.temperature.tolist() == pytest.approx([0.7] * 3) and sp.top_k.dtype == torch.int32
    with pytest.raises(ValueError, match=r"top_k\[2\]=-3"):
        SamplingParams.build(1.0, [0, 1, -3])
    with pytest.raises(ValueError, match="one per request"):
        SamplingParams.build([1.0, 0.0], [0, 1, 2])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.build(float("nan"), num_requests=2)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    good, _ = bad_inputs("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        accept(**good)


# ------------------------------------------------------------------ GPU (-m gpu)
def gpu_case(seed, greedy_share, dtype=torch.bfloat16):
    """R=256 requests, lengths 1..8, V=32000, mixed controls; on the GPU."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 8) for _ in range(256)]
    configs = [G if rng.random() < greedy_share else
               (rng.choice([0.6, 1.0, 1.3]), rng.choice([0, 20, 50]), rng.choice([1.0, 0.9, 0.8]))
               for _ in lens]
    case = make_case(lens, 32000, configs, seed=seed, dtype=dtype)
    return [x.cuda() if isinstance(x, torch.Tensor) else
            type(x)(*(t.cuda() for t in vars(x).values())) for x in case]


@pytest.mark.gpu
def test_gpu_greedy_real_shapes_bitwise():
    logits, ids, qsl, sampling, noise, q = gpu_case(0, greedy_share=1.0)
    assert_same(accept(logits, ids, qsl, sampling, noise), accept_reference(
        logits, ids, qsl, sampling, noise))


@pytest.mark.gpu
@pytest.mark.parametrize("philox", [False, True])
def test_gpu_sampled_real_shapes_match_reference(philox):
    """exp/log on the GPU differ from the CPU's by ulps: a decision within ulps may flip."""
    logits, ids, qsl, sampling, noise, q = gpu_case(1, greedy_share=0.25)
    if philox:
        noise = PhiloxNoise(torch.arange(256, device="cuda"),
                            torch.full((256,), 3, device="cuda"))
    got, want = accept(logits, ids, qsl, sampling, noise, q), accept_reference(
        logits, ids, qsl, sampling, noise, q)
    differ = (got.accept_lens != want.accept_lens) | (got.next_tokens != want.next_tokens)
    assert int(differ.sum()) <= 2, differ.nonzero().flatten().tolist()
    assert int(want.num_accepted_drafts.sum()) > 100  # drafts do get accepted at this shape


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    logits, ids, qsl, sampling, noise, q = gpu_case(2, greedy_share=0.5)
    static = logits.clone()
    accept(static, ids, qsl, sampling, noise, q)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = accept(static, ids, qsl, sampling, noise, q)
    fresh = (torch.randn(static.shape, device="cuda") * 2).to(static.dtype)
    static.copy_(fresh)
    graph.replay()
    assert_same(out, accept(fresh, ids, qsl, sampling, noise, q))
