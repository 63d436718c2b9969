"""Accept step of speculative decoding: greedy matching and rejection sampling (packed-ragged).

Layout (the rest of the package's): request ``i`` owns rows ``qsl[i] : qsl[i + 1]`` of every
``[N, ...]`` tensor, ``L_i = qsl[i + 1] - qsl[i]`` >= 1 rows. ``input_ids`` holds the verify
step's input (the anchor, then the drafts); target row ``n`` predicts the token at input row
``n + 1``. Everything about a draft token lives at *its own* row: ``draft_probs[n]`` is the
drafter's distribution ``q`` that ``input_ids[n]`` was drawn from and ``uniforms[n]`` the
uniform that tests it; the anchor rows of both are unused. Example, lengths 3 and 1::

    query_start_loc = [0, 3, 4]
    input_ids       = [a,       d1,          d2,             b]        a, b: anchors
    target_logits   = [P(.|a),  P(.|a d1),   P(.|a d1 d2),   P(.|b)]
    draft_probs     = [unused,  q1,          q2,             unused]
    uniforms        = [unused,  u1,          u2,             unused]
    gumbel          = [g_0, g_1]                                        one row per request

Request 0 tests ``d1`` against row 0, then ``d2`` against row 1. Both accepted:
``num_accepted_drafts = 2``, ``accept_lens = 3`` (``a d1 d2`` are kept), ``next_tokens`` = a
sample of row 2 (the bonus). ``d2`` rejected: ``1``, ``2`` (``a d1``), and ``next_tokens`` = a
sample of ``max(p_row1 - q2, 0)`` (the recovered token). Request 1 has no draft: ``0``, ``1``,
a sample of row 3. ``accept_lens`` is what ``Verifier.commit(layout, accept_lens, state)``
takes; the emitted tokens are the accepted drafts, then ``next_tokens``.

Rules (the reference below and the Triton kernel follow them exactly):

- Logits are read as float32; NaN counts as -inf and +inf as the largest finite float32.
- Greedy (``temperature <= 0``): draft ``d`` at row ``j`` is accepted iff ``d == argmax``
  (ties: lowest id); the emitted token is the argmax of the final row. Filters are ignored.
- Sampled: top-k on the raw logits keeps every logit ``>= `` the k-th largest (ties kept;
  ``0`` or ``>= V`` is off). Weights ``e = exp((z - m) * inv_t)`` on the kept logits, with
  ``m`` the row max and ``inv_t = min(1 / T, float32 max)``. Top-p keeps every ``e >= t`` for
  the largest ``t`` with ``sum(e >= t) >= top_p * sum(e)`` (``1`` is off); ``p = e * (1 /
  sum(kept e))``. Draft ``d`` is accepted iff ``p[d] > 0 and p[d] >= u * q[d]``. The emitted
  token is ``argmax(log w + g)`` over ``w = max(p - q, 0)`` (``q = 0`` on the bonus row);
  where ``w`` is 0 everywhere it is ``argmax(log p + g)``; where ``p`` is 0 everywhere it is 0.
- ``draft_probs=None`` means a deterministic drafter: ``q`` is one-hot on the draft token.
  NaN or negative ``q`` counts as 0. A draft id outside ``[0, V)`` is rejected.
- An all-NaN or all -inf row emits token 0 (greedy and sampled), never an out-of-range id.
- A request with no row (``qsl[i + 1] == qsl[i]``, a padded slot) gives ``0, 0, 0``.

Noise: :class:`PreDrawnNoise` (tensors; bitwise testable) or :class:`PhiloxNoise` (per-request
seed and step, drawn in the kernel). :func:`draw_philox_noise` reproduces the kernel's Philox
stream in torch, so the reference takes either and both paths compare bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..kernels.targets import TargetConfig, target_for_device
from .values import check_scalar, is_scalar, number, positive_int_arg

__all__ = ["SamplingParams", "PreDrawnNoise", "PhiloxNoise", "AcceptResult", "accept",
           "accept_reference", "draw_philox_noise", "philox4x32", "emitted_tokens"]

_FLT_MAX = torch.finfo(torch.float32).max
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True, eq=False)
class SamplingParams:
    """Per-request sampling controls, one entry per request, on the logits' device."""

    temperature: torch.Tensor
    """float [R] (``build`` makes float32). 0 = greedy (argmax); > 0 divides the kept logits."""
    top_k: torch.Tensor
    """int32 or int64 [R]. 0 = off; k keeps the raw logits >= the k-th largest (ties kept)."""
    top_p: torch.Tensor
    """float [R] in (0, 1]. 1 = off; else the smallest top set of mass >= top_p (ties kept)."""

    @classmethod
    def build(cls, temperature: float | Sequence[float], top_k: int | Sequence[int] = 0,
              top_p: float | Sequence[float] = 1.0, *, num_requests: int | None = None,
              device: torch.device | str = "cpu") -> "SamplingParams":
        """Host values (scalars broadcast to ``num_requests``), checked, as device tensors.

        A value is a real number (``top_k``: an integer), a Python or NumPy scalar (converted as
        it is), or a sequence, NumPy array or tensor of them, one per request; bools (``True``
        is not a temperature) and non-integral ``top_k`` (2.5) are refused, not converted."""
        cols = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        for name, v in cols.items():
            if not is_scalar(v) and not isinstance(v, (list, tuple, np.ndarray, torch.Tensor)):
                raise ValueError(f"SamplingParams.build: {name} is a {type(v).__name__}; it "
                                 "must be a number or a sequence of numbers, one per request")
        sizes = {len(v) for v in cols.values() if not is_scalar(v)}
        if num_requests is not None:
            positive_int_arg("SamplingParams.build", "num_requests", num_requests)
        r = num_requests if num_requests is not None else (sizes.pop() if sizes else 1)
        host = {}
        for name, value in cols.items():
            seq = [value] * r if is_scalar(value) else list(value)
            if len(seq) != r:
                raise ValueError(f"SamplingParams.build: {name} has {len(seq)} entries; every "
                                 f"column needs one per request ({r}); pass a list of {r}")
            for i, x in enumerate(seq):
                check_scalar(name, i, x)
            dtype = torch.int32 if name == "top_k" else torch.float32
            host[name] = torch.tensor([number(x) for x in seq], dtype=dtype)
        _check_values(host["temperature"], host["top_k"], host["top_p"], "SamplingParams.build")
        return cls(**{k: v.to(device) for k, v in host.items()})


@dataclass(frozen=True, eq=False)
class PreDrawnNoise:
    """Noise passed in as tensors (reference and kernel then agree bit for bit)."""

    uniforms: torch.Tensor
    """float32 [N] in [0, 1). ``uniforms[n]`` tests the draft at input row ``n``."""
    gumbel: torch.Tensor
    """float32 [R, V], standard Gumbel: row ``i`` picks request ``i``'s emitted token."""


@dataclass(frozen=True, eq=False)
class PhiloxNoise:
    """Noise drawn in the kernel: Philox-4x32-10 keyed by the seed, countered by the step."""

    seeds: torch.Tensor
    """int64 [R]. Per-request seed (the Philox key)."""
    steps: torch.Tensor
    """int64 [R]. Per-request step (e.g. tokens generated so far); one stream per step."""


class AcceptResult(NamedTuple):
    """Outcome of one accept step, per request."""

    num_accepted_drafts: torch.Tensor
    """int32 [R] in 0 .. L_i - 1: leading drafts accepted."""
    accept_lens: torch.Tensor
    """int32 [R] = num_accepted_drafts + 1: rows to commit (the anchor and accepted drafts)."""
    next_tokens: torch.Tensor
    """int64 [R] in [0, V): the recovered token after a rejection, else the bonus token."""


def _fail(owner: str, msg: str) -> None:
    raise ValueError(f"{owner}: {msg}")


def _check_values(temperature, top_k, top_p, owner: str) -> None:
    """Value rules of the sampling controls (host tensors only: no device sync here)."""
    bad_t = ~(torch.isfinite(temperature) & (temperature >= 0))
    bad_k = top_k < 0
    bad_p = ~((top_p > 0) & (top_p <= 1))
    for name, bad, t, rule in (("temperature", bad_t, temperature, "finite and >= 0 (0: greedy)"),
                               ("top_k", bad_k, top_k, ">= 0 (0: off)"),
                               ("top_p", bad_p, top_p, "in (0, 1] (1: off)")):
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            _fail(owner, f"{name}[{i}]={t[i].item()!r}; it must be {rule}. Fix that request's "
                  "sampling parameters")


def _check_tensor(owner, name, t, dims, dtypes, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(owner, f"{name} is {type(t).__name__}; it must be a tensor")
    if t.dim() != dims:
        _fail(owner, f"{name} has shape {tuple(t.shape)}; it must be {dims}-D")
    if t.dtype not in dtypes:
        _fail(owner, f"{name} has dtype {t.dtype}; it must be one of {list(dtypes)}")
    if t.device != device:
        _fail(owner, f"{name} is on {t.device} but target_logits is on {device}; move it there")
    if dims == 1 and t.numel() > 1 and t.stride(0) != 1:
        _fail(owner, f"{name} has stride {t.stride(0)}; the kernel reads it densely, pass "
              ".contiguous()")


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


def _check_inputs(owner, target_logits, input_ids, query_start_loc, sampling, noise,
                  draft_probs) -> None:
    """Shapes, dtypes and devices of every argument; values too where they live on the CPU."""
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
        _fail(owner, "target_logits must be a 2-D [N, V] tensor")
    dev = target_logits.device
    n, v = target_logits.shape
    _check_tensor(owner, "target_logits", target_logits, 2, _FLOATS, dev)
    if v < 1 or v > 2 ** 24 or target_logits.stride(1) != 1:
        _fail(owner, f"target_logits {tuple(target_logits.shape)} needs 1 <= V <= 2^24 (counts "
              "are exact float32 sums) and a dense last dim; pass .contiguous()")
    _check_tensor(owner, "input_ids", input_ids, 1, _INTS, dev)
    _check_tensor(owner, "query_start_loc", query_start_loc, 1, _INTS, dev)
    r = query_start_loc.shape[0] - 1
    if input_ids.shape[0] != n or r < 0:
        _fail(owner, f"input_ids {tuple(input_ids.shape)} must be [N={n}] and query_start_loc "
              f"{tuple(query_start_loc.shape)} must be [R + 1]")
    if not isinstance(sampling, SamplingParams):
        _fail(owner, f"sampling is {type(sampling).__name__}; build a SamplingParams")
    for name, t, dtypes in (("temperature", sampling.temperature, _FLOATS),
                            ("top_k", sampling.top_k, _INTS), ("top_p", sampling.top_p, _FLOATS)):
        _check_tensor(owner, f"sampling.{name}", t, 1, dtypes, dev)
        if t.shape[0] != r:
            _fail(owner, f"sampling.{name} has {t.shape[0]} entries; it needs R={r}")
    _check_noise(owner, noise, n, r, v, dev)
    if draft_probs is not None:
        _check_tensor(owner, "draft_probs", draft_probs, 2, _FLOATS, dev)
        if tuple(draft_probs.shape) != (n, v) or draft_probs.stride(1) != 1:
            _fail(owner, f"draft_probs {tuple(draft_probs.shape)} must be [N, V] = {(n, v)} "
                  "with a dense last dim, row n holding q of the draft at input row n")
    if dev.type == "cpu":  # free on the host; device values are checked where they are built
        _check_layout_values(owner, query_start_loc, n)
        _check_values(sampling.temperature, sampling.top_k, sampling.top_p, owner)


def _check_noise(owner, noise, n, r, v, dev) -> None:
    if isinstance(noise, PreDrawnNoise):
        _check_tensor(owner, "noise.uniforms", noise.uniforms, 1, (torch.float32,), dev)
        _check_tensor(owner, "noise.gumbel", noise.gumbel, 2, (torch.float32,), dev)
        if noise.uniforms.shape[0] != n or tuple(noise.gumbel.shape) != (r, v) or \
                noise.gumbel.stride(1) != 1:
            _fail(owner, f"noise.uniforms {tuple(noise.uniforms.shape)} must be [N={n}] and "
                  f"noise.gumbel {tuple(noise.gumbel.shape)} [R, V] = {(r, v)}, dense rows")
    elif isinstance(noise, PhiloxNoise):
        for name in ("seeds", "steps"):
            t = getattr(noise, name)
            _check_tensor(owner, f"noise.{name}", t, 1, (torch.int64,), dev)
            if t.shape[0] != r:
                _fail(owner, f"noise.{name} has {t.shape[0]} entries; it needs R={r}")
    else:
        _fail(owner, f"noise is {type(noise).__name__}; pass PreDrawnNoise or PhiloxNoise")


def _check_layout_values(owner, query_start_loc, n) -> None:
    qsl = query_start_loc.long()
    if qsl[0] != 0 or (qsl[1:] < qsl[:-1]).any() or qsl[-1] > n:
        _fail(owner, f"query_start_loc={qsl.tolist()} must start at 0, never decrease and end "
              f"<= N={n} (rows past it are padding)")


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``m * c`` (``c`` int64 holding uint32) without int64 overflow."""
    c_hi, c_lo = c >> 16, c & 0xFFFF
    a_hi, a_lo = m * c_hi, m * c_lo  # each < 2^48
    return (a_hi + (a_lo >> 16)) >> 16, (((a_hi & 0xFFFF) << 16) + a_lo) & _MASK32


def philox4x32(seed: torch.Tensor, counter: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Philox-4x32-10 (Random123): key = int64 ``seed`` (low, high words), 4 uint32 counters.

    Tensors broadcast; words travel as int64 holding uint32 values. Returns the 4 output words.
    """
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    for _ in range(10):
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return [c0, c1, c2, c3]


def _philox_uniform(seed, step, stream: int, counter) -> torch.Tensor:
    """The kernel's uniform: top 23 bits of word 0 as ``(2k + 1) * 2^-24``, float32, exact."""
    word = philox4x32(seed, [counter, step & _MASK32, (step >> 32) & _MASK32, stream])[0]
    return ((word >> 9) * 2 + 1).to(torch.float32) * 2.0 ** -24


def draw_philox_noise(noise: PhiloxNoise, query_start_loc: torch.Tensor, num_tokens: int,
                      vocab_size: int) -> PreDrawnNoise:
    """The uniforms and Gumbel noise the kernel draws for ``noise``, as tensors.

    Uniform of input row ``qsl[i] + j``: stream 0, counter ``j``. Gumbel of request ``i``,
    token ``v``: ``-log(-log(u))``, stream 1, counter ``v``. Rows past ``qsl[R]`` get 0.5.
    """
    dev = noise.seeds.device
    qsl = query_start_loc.to(dev, torch.int64)
    rows = torch.arange(num_tokens, device=dev)  # [N]
    req = (torch.searchsorted(qsl, rows, right=True) - 1).clamp(0, max(qsl.numel() - 2, 0))
    uniforms = torch.full((num_tokens,), 0.5, dtype=torch.float32, device=dev)
    if qsl.numel() > 1:
        own = rows < qsl[-1]
        u = _philox_uniform(noise.seeds[req], noise.steps[req], 0, rows - qsl[req])
        uniforms = torch.where(own, u, uniforms)
    vocab = torch.arange(vocab_size, device=dev)[None, :]  # [1, V]
    u = _philox_uniform(noise.seeds[:, None], noise.steps[:, None], 1, vocab)  # [R, V]
    return PreDrawnNoise(uniforms, -torch.log(-torch.log(u)))


def _sanitize(z: torch.Tensor) -> torch.Tensor:
    """float32; NaN -> -inf; +inf -> float32 max."""
    z = z.float()
    return torch.where(torch.isnan(z), float("-inf"), z).clamp(max=_FLT_MAX)


def _target_probs(z: torch.Tensor, temperature: torch.Tensor, k: int, top_p: torch.Tensor):
    """``p [L, V]`` of a sampled request's sanitised rows ``z [L, V]`` (see the rules)."""
    inv_t = (1.0 / temperature).clamp(max=_FLT_MAX)
    m = z.amax(-1, keepdim=True)  # [L, 1] (max(dim) took ~5 ms a call on torch 2.13 CPU)
    m = torch.where(m == float("-inf"), 0.0, m)
    v = z.shape[-1]
    kth = torch.topk(z, k, -1).values[:, -1:] if 0 < k < v else torch.full_like(m, -float("inf"))
    keep = (z >= kth) & (z > float("-inf"))
    e = torch.where(keep, torch.exp((z - m) * inv_t), 0.0)  # [L, V]
    if 0 < top_p < 1:
        es = torch.sort(e, -1, descending=True).values
        above = torch.cat([torch.zeros_like(es[:, :1]), torch.cumsum(es, -1)[:, :-1]], -1)
        n_keep = (above < top_p * e.sum(-1, keepdim=True)).sum(-1, keepdim=True)  # [L, 1]
        thr = es.gather(-1, (n_keep - 1).clamp(min=0))
        e = torch.where((e >= thr) & (n_keep > 0), e, 0.0)
    mass = e.sum(-1, keepdim=True)
    inv_z = torch.where(mass > 0, 1.0 / torch.where(mass > 0, mass, 1.0), 0.0)
    return e * inv_z


def _gumbel_pick(p: torch.Tensor, q: torch.Tensor, g: torch.Tensor) -> int:
    """``argmax(log w + g)`` over ``w = max(p - q, 0)``, else over ``p``, else 0."""
    for w in (torch.clamp_min(p - q, 0.0), p):
        score = torch.where(w > 0, torch.log(torch.where(w > 0, w, 1.0)) + g, -float("inf"))
        score = torch.where(torch.isnan(score), -float("inf"), score)
        if score.amax() > -float("inf"):
            return int(torch.argmax(score))  # first index of the max
    return 0


def _clean_q(q: torch.Tensor) -> torch.Tensor:
    """Draft probabilities as the kernel reads them: NaN and negative values count as 0."""
    return torch.where(q > 0, q, 0.0)


def _accept_one(z, d_ids, q_rows, uniforms, gumbel, temperature, k, top_p) -> tuple[int, int]:
    """One request: rows ``z [L, V]``, drafts ``d_ids [L - 1]``; ``(accepted, token)``."""
    length, v = z.shape
    if not temperature > 0:
        amax = [int(torch.argmax(row)) for row in z]
        j = 0
        while j < length - 1 and int(d_ids[j]) == amax[j]:
            j += 1
        return j, amax[j]
    p = _target_probs(z, temperature, k, top_p)  # [L, V]
    j = 0
    while j < length - 1:
        d = int(d_ids[j])
        ok = 0 <= d < v
        p_d = p[j, d] if ok else torch.zeros(())
        q_d = _clean_q(q_rows[j, d]) if q_rows is not None and ok else 1.0
        if not (p_d > 0 and p_d >= uniforms[j] * q_d):
            break
        j += 1
    q = torch.zeros(v)
    if j < length - 1:
        if q_rows is not None:
            q = _clean_q(q_rows[j])
        elif 0 <= int(d_ids[j]) < v:
            q[int(d_ids[j])] = 1.0
    return j, _gumbel_pick(p[j], q, gumbel)


def accept_reference(target_logits: torch.Tensor, input_ids: torch.Tensor,
                     query_start_loc: torch.Tensor, sampling: SamplingParams,
                     noise: PreDrawnNoise | PhiloxNoise,
                     draft_probs: torch.Tensor | None = None) -> AcceptResult:
    """Pure-torch accept step (the oracle): same arguments and result as :func:`accept`."""
    owner = "accept_reference"
    _check_inputs(owner, target_logits, input_ids, query_start_loc, sampling, noise, draft_probs)
    n, v = target_logits.shape
    if isinstance(noise, PhiloxNoise):
        noise = draw_philox_noise(noise, query_start_loc, n, v)
    dev, cpu = target_logits.device, torch.device("cpu")
    qsl = query_start_loc.tolist()
    r = len(qsl) - 1
    out = torch.zeros(3, r, dtype=torch.int64)
    for i in range(r):
        lo, hi = qsl[i], qsl[i + 1]
        if hi <= lo:
            continue
        q_rows = draft_probs[lo + 1:hi].to(cpu).float() if draft_probs is not None else None
        j, token = _accept_one(_sanitize(target_logits[lo:hi].to(cpu)), input_ids[lo + 1:hi].cpu(),
                               q_rows, noise.uniforms[lo + 1:hi].cpu(), noise.gumbel[i].cpu(),
                               sampling.temperature[i].cpu().float(), int(sampling.top_k[i]),
                               sampling.top_p[i].cpu().float())
        out[:, i] = torch.tensor([j, j + 1, token])
    return AcceptResult(out[0].to(dev, torch.int32), out[1].to(dev, torch.int32), out[2].to(dev))


def accept(target_logits: torch.Tensor, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
           sampling: SamplingParams, noise: PreDrawnNoise | PhiloxNoise,
           draft_probs: torch.Tensor | None = None,
           config: TargetConfig | None = None) -> AcceptResult:
    """Triton accept step: two launches, no host sync (CUDA-graph safe on a GPU).

    ``target_logits [N, V]`` (fp32/bf16/fp16), ``input_ids [N]``, ``query_start_loc [R + 1]``
    and ``draft_probs [N, V]`` (or None: one-hot drafts) are laid out as the module docstring
    shows. ``config`` overrides the per-target table entry (tests). CPU tensors run under
    ``TRITON_INTERPRET=1``; use :func:`accept_reference` for the CPU path without it.
    """
    owner = "accept"
    _check_inputs(owner, target_logits, input_ids, query_start_loc, sampling, noise, draft_probs)
    if target_logits.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        _fail(owner, "CPU tensors need TRITON_INTERPRET=1 set before triton kernels are "
              "imported; for the CPU path call dspark_compile.engine.accept_reference")
    from .accept_triton import launch_accept  # kept local: decorating kernels reads the env

    if isinstance(noise, PreDrawnNoise):
        tensors = (noise.uniforms, noise.gumbel, None, None)
    else:
        tensors = (None, None, noise.seeds, noise.steps)
    return AcceptResult(*launch_accept(
        target_logits, input_ids, query_start_loc, sampling.temperature, sampling.top_k,
        sampling.top_p, draft_probs, *tensors, config or target_for_device(target_logits.device)))


def emitted_tokens(input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                   result: AcceptResult) -> list[list[int]]:
    """Host helper (syncs): request ``i``'s emitted tokens, accepted drafts then the next token."""
    qsl, ids = query_start_loc.tolist(), input_ids.tolist()
    acc, nxt = result.num_accepted_drafts.tolist(), result.next_tokens.tolist()
    return [ids[qsl[i] + 1: qsl[i] + 1 + acc[i]] + [nxt[i]] if qsl[i + 1] > qsl[i] else []
            for i in range(len(qsl) - 1)]
