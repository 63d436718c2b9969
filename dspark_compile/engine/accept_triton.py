"""Triton kernels of the accept step: greedy matching and rejection sampling, two launches.

Kernels first, then the launch (the order of the Triton tutorials). The rules these kernels
follow, the layout, the oracle and the argument checks live in
:mod:`dspark_compile.engine.accept` (read its docstring first).

Design:

- Whether row ``n`` accepts its draft (input row ``n + 1``) depends on row ``n`` alone, not on
  the rows before it; only *reaching* row ``n`` does. So ``_row_kernel`` runs one program per
  packed row (grid ``(N,)``): it decides ``accepted[n]`` and, where the request would stop
  there (a rejection, or its last row), the token it would emit. ``_select_kernel`` (grid
  ``(R,)``) then walks each request's flags to its first stop. All rows of a step run side by
  side (2048 programs at R=256, L=8 instead of 256 sequential walks), at the price of also
  deciding rows after a rejection. Grids come from shapes; no host sync.
- A program finds its request by counting ``query_start_loc`` entries ``<= n`` (``SEARCH`` per
  load); rows past ``qsl[R]`` are padding and exit.
- Every pass over a row loops over vocab tiles, so V up to 2^24 fits one program. Greedy: one
  pass (max and first argmax). Sampled: the max pass, a mass pass and, per active filter, one
  threshold search.
- Thresholds are found without sorting: top-k is the largest order-preserving int32 key ``t``
  of the raw logits with ``count(key >= t) >= k``; top-p is the largest bit pattern ``t`` of
  the (non-negative) weights ``e`` with ``sum(e : bits(e) >= t) >= top_p * sum(e)``. Both
  measures fall as ``t`` rises, so a search testing ``FANOUT`` candidates per pass (a
  ``[BLOCK_S, FANOUT]`` compare per tile) ends in ``log_{FANOUT+1}(2^32)`` passes. The result
  is a value of the row, so ties at the threshold are all kept, as in the reference.
- The emitted token is a Gumbel-max in one pass: ``argmax(log max(p - q, 0) + g)``, tracking
  ``argmax(log p + g)`` beside it for a ``max(p - q, 0)`` that is 0 everywhere.
- Noise is read (``uniforms [N]``, ``gumbel [R, V]``) or drawn with Philox-4x32-10 (key: the
  request's seed; counter: index, step low word, step high word, stream), which
  :func:`dspark_compile.engine.accept.draw_philox_noise` reproduces bit for bit.
- Tile loops call no ``@triton.jit`` helper and reduce once per pass (per-lane accumulators):
  under ``TRITON_INTERPRET=1`` (triton 3.9) every device-function call, ``tl.sum`` and
  ``tl.max`` included, re-patches ``triton.language`` (milliseconds each); removing them from
  the loops cut a top-k + top-p row ~3x there. Compiled code inlines either way, and
  per-lane accumulators also spare the GPU a cross-thread reduction per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.targets import TargetConfig

__all__ = ["FANOUT", "accept_tiles", "launch_accept"]

FANOUT = 8
"""Threshold candidates per search pass: ``log_9(2^32)`` -> 11 passes for top-k, 10 for top-p.
Not tuned on a GPU yet: 1 (bisection) takes 32 passes of 1 compare per logit, 16 takes 8 of
16 and twice the accumulator registers (64 per thread at 4 warps instead of 32). Under the
interpreter (V=1000, one top-k + top-p row, loaded 2-core host) 4 / 8 / 16 took 0.21 / 0.22 /
0.12 s: there fewer passes win, which says nothing about the GPU."""

_SEARCH_MAX = 1024  # request lookup: one load of qsl covers R < 1024; larger R loops
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_TWO_M24 = tl.constexpr(5.960464477539063e-08)  # 2 ** -24
_KEY_NEG_INF = tl.constexpr(-2139095041)  # order key of -inf: 0xFF800000 ^ 0x7FFFFFFF (int32)
_KEY_END = tl.constexpr(2139095040)  # order key of the largest finite float32 (0x7F7FFFFF) + 1
_BITS_END = tl.constexpr(1065353217)  # bit pattern of 1.0 (0x3F800000, the largest e) + 1


@triton.jit
def _philox_uniform(seed, step, stream: tl.constexpr, counter):
    """Uniform in ``(0, 1)`` of Philox-4x32-10, key ``seed``, counter ``(counter, step, stream)``.

    Word 0 of the output, top 23 bits, as ``(2k + 1) * 2^-24``: exact in float32, never 0 or 1.
    """
    c0 = counter.to(tl.uint32)
    zero = c0 * 0
    c1 = zero + step.to(tl.uint32)
    c2 = zero + (step >> 32).to(tl.uint32)
    c3 = zero + stream
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    m0 = tl.full([], 0xD2511F53, tl.uint32)  # round multipliers
    m1 = tl.full([], 0xCD9E8D57, tl.uint32)
    w0 = tl.full([], 0x9E3779B9, tl.uint32)  # key schedule (Weyl) increments
    w1 = tl.full([], 0xBB67AE85, tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(m0, c0)
        hi1 = tl.umulhi(m1, c2)
        lo0 = m0 * c0
        lo1 = m1 * c2
        c0 = hi1 ^ c1 ^ k0
        c2 = hi0 ^ c3 ^ k1
        c1 = lo1
        c3 = lo0
        k0 = k0 + w0
        k1 = k1 + w1
    return ((c0 >> 9).to(tl.int32) * 2 + 1).to(tl.float32) * _TWO_M24


@triton.jit
def _find_request(qsl_ptr, row, num_requests, SEARCH: tl.constexpr):
    """Request owning packed row ``row``: the count of ``qsl[1..R]`` entries ``<= row``.

    ``R`` for a row past ``qsl[R]`` (padding). Empty requests own no row and are skipped.
    """
    offs = tl.arange(0, SEARCH)
    count = 0
    for c in range(1, num_requests + 1, SEARCH):
        i = c + offs
        ends = tl.load(qsl_ptr + i, mask=i <= num_requests, other=0)
        count += tl.sum(((ends <= row) & (i <= num_requests)).to(tl.int32))
    return count


@triton.jit
def _search(row_ptr, vocab, lo, hi, mass_lo, target, m, inv_t, kth, TOP_P: tl.constexpr,
            BLOCK_S: tl.constexpr, FANOUT: tl.constexpr):
    """Largest key ``t`` in ``[lo, hi)`` with ``measure(t) >= target``, and ``measure(t)``.

    ``measure(t)`` counts the logits whose order key is ``>= t`` (top-k) or sums the weights
    ``e`` whose bit pattern is ``>= t`` (top-p). It does not rise with ``t`` (float sums of
    non-negative terms in a fixed order are monotone); ``lo`` meets the target, ``hi`` does
    not, and each pass tests ``FANOUT`` evenly spaced candidates between them.
    """
    steps = tl.arange(1, FANOUT + 1).to(tl.int64)  # [FANOUT]
    while hi - lo > 1:
        width = hi - lo
        cands = (lo + steps * width // (FANOUT + 1)).to(tl.int32)  # [FANOUT], inside [lo, hi)
        acc = tl.full([BLOCK_S, FANOUT], 0.0, tl.float32)  # per-lane sums: one reduce a pass
        for v0 in range(0, vocab, BLOCK_S):
            offs = v0 + tl.arange(0, BLOCK_S)
            z = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            z = tl.where(z != z, float("-inf"), z)  # [BLOCK_S]
            if TOP_P:
                z = tl.minimum(z, _FLT_MAX)
                keep = (z >= kth) & (z > float("-inf"))
                w = tl.where(keep, tl.exp((z - m) * inv_t), 0.0)
                key = w.to(tl.int32, bitcast=True)  # e >= 0: bit patterns are ordered
                acc += tl.where(key[:, None] >= cands[None, :], w[:, None], 0.0)
            else:
                # Lanes past V (-inf) hit no candidate above lo; +inf hits every candidate
                # (< hi = key(+inf)), as float32 max would.
                bits = z.to(tl.int32, bitcast=True)
                key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                acc += (key[:, None] >= cands[None, :]).to(tl.float32)
        meas = tl.sum(acc, 0)  # [FANOUT]
        n_ok = tl.sum((meas >= target).to(tl.int64), 0)  # candidates meeting it: a prefix
        mass_lo = tl.where(n_ok > 0, tl.sum(tl.where(steps == n_ok, meas, 0.0), 0), mass_lo)
        hi = tl.where(n_ok < FANOUT, lo + (n_ok + 1) * width // (FANOUT + 1), hi)
        lo = tl.where(n_ok > 0, lo + n_ok * width // (FANOUT + 1), lo)
    return lo, mass_lo


@triton.jit
def _row_stats(row_ptr, vocab, sampled, inv_t, top_k, top_p, BLOCK_V: tl.constexpr,
               BLOCK_S: tl.constexpr, FANOUT: tl.constexpr):
    """``(m, argmax, kth, thr, inv_z)`` of one row: ``p[v] = e[v] * inv_z`` where ``z[v] >=
    kth`` and ``e[v] >= thr``, else 0. A greedy row stops after the max pass (``inv_z = 0``)."""
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: max and its first index
    idx = tl.full([BLOCK_V], 0, tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        z = tl.minimum(tl.where(z != z, float("-inf"), z), _FLT_MAX)
        idx = tl.where(z > best, offs, idx)  # strict: a lane keeps its first max
        best = tl.maximum(z, best)
    m = tl.max(best, 0)
    amax = tl.min(tl.where(best == m, idx, 2147483647), 0)  # lowest id of the max
    m = tl.where(m == float("-inf"), 0.0, m)  # all -inf row: every weight is 0, no NaN
    kth = tl.full([], float("-inf"), tl.float32)
    thr = tl.full([], 0.0, tl.float32)
    inv_z = tl.full([], 0.0, tl.float32)
    if sampled:
        if (top_k > 0) & (top_k < vocab):
            key, _ = _search(row_ptr, vocab, tl.full([], _KEY_NEG_INF, tl.int64),
                             tl.full([], _KEY_END, tl.int64), tl.full([], 0.0, tl.float32) + vocab,
                             top_k.to(tl.float32), m, inv_t, kth, False, BLOCK_S, FANOUT)
            bits = key.to(tl.int32)
            kth = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        acc = tl.full([BLOCK_V], 0.0, tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
            z = tl.minimum(tl.where(z != z, float("-inf"), z), _FLT_MAX)
            acc += tl.where((z >= kth) & (z > float("-inf")), tl.exp((z - m) * inv_t), 0.0)
        mass = tl.sum(acc, 0)
        if (top_p > 0.0) & (top_p < 1.0):
            key, mass = _search(row_ptr, vocab, tl.full([], 0, tl.int64),
                                tl.full([], _BITS_END, tl.int64), mass, top_p * mass, m,
                                inv_t, kth, True, BLOCK_S, FANOUT)
            thr = key.to(tl.int32).to(tl.float32, bitcast=True)
        inv_z = tl.where(mass > 0, tl.math.div_rn(1.0, tl.where(mass > 0, mass, 1.0)), 0.0)
    return m, amax, kth, thr, inv_z


@triton.jit
def _emit_sampled(row_ptr, q_row_ptr, gumbel_row_ptr, d, q_end, vocab, m, inv_t, kth, thr,
                  inv_z, seed, step, HAS_DRAFT_PROBS: tl.constexpr, PHILOX: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """Gumbel-max over ``max(p - q, 0)``, else over ``p``, else 0 (ties: lowest id).

    ``q`` is read (or one-hot on ``d``) on lanes ``< q_end``: ``vocab`` after a rejection,
    0 on the bonus row (then ``w = p``).
    """
    best_w = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane, as in _row_stats
    best_p = tl.full([BLOCK_V], float("-inf"), tl.float32)
    idx_w = tl.full([BLOCK_V], 0, tl.int32)
    idx_p = tl.full([BLOCK_V], 0, tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        z = tl.minimum(tl.where(z != z, float("-inf"), z), _FLT_MAX)
        e = tl.where((z >= kth) & (z > float("-inf")), tl.exp((z - m) * inv_t), 0.0)
        p = tl.where(e >= thr, e * inv_z, 0.0)  # [BLOCK_V]
        if HAS_DRAFT_PROBS:
            q = tl.load(q_row_ptr + offs, mask=offs < q_end, other=0.0).to(tl.float32)
            q = tl.where(q > 0, q, 0.0)  # NaN or negative q counts as 0
        else:
            q = tl.where((offs == d) & (offs < q_end), 1.0, 0.0)
        if PHILOX:
            g = -tl.log(-tl.log(_philox_uniform(seed, step, 1, offs)))
        else:
            g = tl.load(gumbel_row_ptr + offs, mask=offs < vocab, other=0.0).to(tl.float32)
        w = tl.maximum(p - q, 0.0)
        s_w = tl.where(w > 0, tl.log(tl.where(w > 0, w, 1.0)) + g, float("-inf"))
        s_p = tl.where(p > 0, tl.log(tl.where(p > 0, p, 1.0)) + g, float("-inf"))
        s_w = tl.where(s_w == s_w, s_w, float("-inf"))  # NaN noise never wins
        s_p = tl.where(s_p == s_p, s_p, float("-inf"))
        idx_w = tl.where(s_w > best_w, offs, idx_w)
        idx_p = tl.where(s_p > best_p, offs, idx_p)
        best_w = tl.maximum(s_w, best_w)
        best_p = tl.maximum(s_p, best_p)
    max_w = tl.max(best_w, 0)
    max_p = tl.max(best_p, 0)
    tok_w = tl.min(tl.where(best_w == max_w, idx_w, 2147483647), 0)
    tok_p = tl.min(tl.where(best_p == max_p, idx_p, 2147483647), 0)
    return tl.where(max_w > float("-inf"), tok_w, tl.where(max_p > float("-inf"), tok_p, 0))


@triton.jit
def _takes_draft(row_ptr, q_row_ptr, d, u, vocab, sampled, amax, m, inv_t, kth, thr, inv_z,
                 HAS_DRAFT_PROBS: tl.constexpr):
    """Greedy: ``d == argmax``. Sampled: ``p[d] > 0 and p[d] >= u * q[d]``. Ids off V fail."""
    in_vocab = (d >= 0) & (d < vocab)
    d_safe = tl.where(in_vocab, d, 0)
    z_d = tl.load(row_ptr + d_safe).to(tl.float32)
    z_d = tl.minimum(tl.where(z_d != z_d, float("-inf"), z_d), _FLT_MAX)
    e_d = tl.where((z_d >= kth) & (z_d > float("-inf")), tl.exp((z_d - m) * inv_t), 0.0)
    p_d = tl.where(in_vocab & (e_d >= thr), e_d * inv_z, 0.0)
    if HAS_DRAFT_PROBS:
        q_d = tl.load(q_row_ptr + d_safe).to(tl.float32)
        q_d = tl.where(q_d > 0, q_d, 0.0)  # NaN or negative q counts as 0
    else:
        q_d = 1.0  # a deterministic drafter: q is one-hot on its token
    return tl.where(sampled, (p_d > 0) & (p_d >= u * q_d), in_vocab & (d == amax))


@triton.jit
def _row_kernel(logits_ptr, input_ids_ptr, qsl_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
                draft_probs_ptr, uniforms_ptr, gumbel_ptr, seeds_ptr, steps_ptr, stop_ptr,
                token_ptr, num_requests, vocab, stride_logits, stride_draft, stride_gumbel,
                HAS_DRAFT_PROBS: tl.constexpr, PHILOX: tl.constexpr, SEARCH: tl.constexpr,
                BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, FANOUT: tl.constexpr):
    """Row ``n``: does it stop its request (reject, or last row), and with which token."""
    row = tl.program_id(0).to(tl.int64)
    req = _find_request(qsl_ptr, row, num_requests, SEARCH)
    if req >= num_requests:  # padding row
        return
    start = tl.load(qsl_ptr + req).to(tl.int64)
    has_draft = row + 1 < tl.load(qsl_ptr + req + 1).to(tl.int64)
    d_row = tl.where(has_draft, row + 1, row)  # input row of the draft (a valid row if none)
    temperature = tl.load(temperature_ptr + req).to(tl.float32)
    sampled = temperature > 0  # 0 (and NaN) mean greedy
    inv_t = tl.minimum(tl.math.div_rn(1.0, tl.where(sampled, temperature, 1.0)), _FLT_MAX)
    row_ptr = logits_ptr + row * stride_logits
    m, amax, kth, thr, inv_z = _row_stats(row_ptr, vocab, sampled, inv_t,
                                          tl.load(top_k_ptr + req).to(tl.int32),
                                          tl.load(top_p_ptr + req).to(tl.float32), BLOCK_V,
                                          BLOCK_S, FANOUT)
    d = tl.load(input_ids_ptr + d_row).to(tl.int64)
    seed = tl.full([], 0, tl.int64)
    step = tl.full([], 0, tl.int64)
    if PHILOX:
        seed = tl.load(seeds_ptr + req).to(tl.int64)
        step = tl.load(steps_ptr + req).to(tl.int64)
        u = tl.full([], 0.0, tl.float32)
        if sampled & has_draft:  # ~100 integer ops: only where a uniform is used
            u = _philox_uniform(seed, step, 0, row - start + 1)
    else:
        u = tl.load(uniforms_ptr + d_row).to(tl.float32)
    accepted = has_draft & _takes_draft(row_ptr, draft_probs_ptr + d_row * stride_draft, d, u,
                                        vocab, sampled, amax, m, inv_t, kth, thr, inv_z,
                                        HAS_DRAFT_PROBS)
    token = amax.to(tl.int64)
    if sampled & (accepted == 0):
        token = _emit_sampled(row_ptr, draft_probs_ptr + d_row * stride_draft,
                              gumbel_ptr + req.to(tl.int64) * stride_gumbel, d,
                              tl.where(has_draft, vocab, 0), vocab, m, inv_t, kth, thr, inv_z,
                              seed, step, HAS_DRAFT_PROBS, PHILOX, BLOCK_V).to(tl.int64)
    tl.store(stop_ptr + row, (accepted == 0).to(tl.int8))
    tl.store(token_ptr + row, token)


@triton.jit
def _select_kernel(qsl_ptr, stop_ptr, token_ptr, num_accepted_ptr, accept_lens_ptr,
                   next_tokens_ptr):
    """Request ``i``: its first stopping row ``j`` gives ``(j, j + 1, token[j])``."""
    req = tl.program_id(0)
    start = tl.load(qsl_ptr + req).to(tl.int64)
    length = tl.load(qsl_ptr + req + 1).to(tl.int64) - start
    j = start * 0
    token = start * 0  # a request with no row (a padded slot) gives 0, 0, 0
    if length > 0:
        while tl.load(stop_ptr + start + j) == 0:  # the last row always stops
            j += 1
        token = tl.load(token_ptr + start + j)
    tl.store(num_accepted_ptr + req, j.to(tl.int32))
    tl.store(accept_lens_ptr + req, tl.where(length > 0, j + 1, 0).to(tl.int32))
    tl.store(next_tokens_ptr + req, token)


def accept_tiles(cfg: TargetConfig) -> tuple[int, int, int]:
    """``(BLOCK_V, BLOCK_S, num_warps)`` of a target, from the shared per-target table.

    Warps: the table's reduction width (``reduce_num_warps``); 8 logits per thread per tile,
    so ``BLOCK_V`` is 1024 on NVIDIA (warp 32) and 2048 on CDNA (wavefront 64). A search tile
    is ``BLOCK_V / 2`` logits x ``FANOUT`` candidates: 32 float32 accumulators per thread.
    Under the interpreter an op costs about the same at any size, so wide tiles matter there:
    ``BLOCK_V / FANOUT`` took 0.41 s per top-k + top-p row at V=1000 against 0.22 s.
    """
    block_v = cfg.warp_size * cfg.reduce_num_warps * 8
    return block_v, block_v // 2, cfg.reduce_num_warps


def launch_accept(target_logits: torch.Tensor, input_ids: torch.Tensor,
                  query_start_loc: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, draft_probs: torch.Tensor | None,
                  uniforms: torch.Tensor | None, gumbel: torch.Tensor | None,
                  seeds: torch.Tensor | None, steps: torch.Tensor | None,
                  cfg: TargetConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch both kernels on checked inputs (see ``engine.accept.accept``).

    Either ``uniforms`` and ``gumbel`` or ``seeds`` and ``steps`` are given. Returns
    ``(num_accepted_drafts [R] int32, accept_lens [R] int32, next_tokens [R] int64)``.
    """
    n, vocab = target_logits.shape
    r = query_start_loc.shape[0] - 1
    dev = target_logits.device
    num_accepted = torch.empty(r, dtype=torch.int32, device=dev)
    accept_lens = torch.empty(r, dtype=torch.int32, device=dev)
    next_tokens = torch.empty(r, dtype=torch.int64, device=dev)
    if r == 0:
        return num_accepted, accept_lens, next_tokens
    stop = torch.empty(n, dtype=torch.int8, device=dev)  # [N] row ends its request
    token = torch.empty(n, dtype=torch.int64, device=dev)  # [N] token emitted if it does
    # absent inputs get a live tensor of the right kind: the kernel never reads them
    draft = draft_probs if draft_probs is not None else target_logits
    gumbel_arg = gumbel if gumbel is not None else target_logits
    block_v, block_s, num_warps = accept_tiles(cfg)
    if n > 0:
        _row_kernel[(n,)](
            target_logits, input_ids, query_start_loc, temperature, top_k, top_p, draft,
            uniforms if uniforms is not None else temperature, gumbel_arg,
            seeds if seeds is not None else query_start_loc,
            steps if steps is not None else query_start_loc, stop, token, r, vocab,
            target_logits.stride(0), draft.stride(0), gumbel_arg.stride(0),
            HAS_DRAFT_PROBS=draft_probs is not None, PHILOX=seeds is not None,
            SEARCH=min(triton.next_power_of_2(r), _SEARCH_MAX), BLOCK_V=block_v,
            BLOCK_S=block_s, FANOUT=FANOUT, num_warps=num_warps)
    _select_kernel[(r,)](query_start_loc, stop, token, num_accepted, accept_lens, next_tokens,
                         num_warps=1)
    return num_accepted, accept_lens, next_tokens
