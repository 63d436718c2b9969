"""Check one architecture: its tiny random model, compiled, against HF's own forward.

A prefill of three prompts, then three verify/commit rounds with different draft lengths per
request and a different accepted prefix each; every verified row of every round is compared
with HF's forward over that request's committed + drafted tokens alone (no KV cache, eager
attention). The outcome is one of :data:`STATUSES`.
"""

from __future__ import annotations

import copy
import inspect
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..frontend.own_forward import config_token_ids
from .tiny import tiny_config

__all__ = ["STATUSES", "TOLERANCE", "GPU_TOLERANCE", "HALF_RATIO", "HALF_FLOOR", "DTYPES",
           "Entry", "entries", "check", "classify", "tolerance"]

STATUSES = ("exact", "refused", "wrong", "error", "skipped")
"""``exact``: every row within :data:`TOLERANCE`; ``refused``: the library raised its refusal
(a message naming what is unsupported); ``wrong``: it ran and a row is off (the worst outcome);
``error``: any other exception, a hang or a crash (a bug to fix); ``skipped``: the zoo could not
build or run the HF model itself (the reason says which step)."""

TOLERANCE = 1e-5
"""Largest |ragged - HF| of an exact architecture (float32, CPU, reference lowering), for a row
whose largest |logit| is at most 1; a row of larger logits is allowed that multiple of it
(:func:`row_bound`): float32 rounding grows with the value (its step at 16 is 1.9e-6), so a
model whose muP or logit multiplier scales its logits 40-fold moves them 40-fold more, where a
wrong mask, head or term moves a logit by orders of magnitude more than either."""

GPU_TOLERANCE = 1e-4
"""The same on a GPU (float32, the Triton lowering against HF's CUDA forward at torch's default
float32 matmul precision): the kernels sum in another order than cuBLAS and HF's attention. On
the H200 the worst exact architecture was 3.8e-6 off with IEEE float32 dots (``zoo_gpu_rest``,
``zoo_gpu_moe_variants``); TF32 dots put every logit ~3e-4 off (the runs before them were judged
at 2e-3)."""


def tolerance(device: str) -> float:
    """The exactness bound of a check run on ``device``."""
    return TOLERANCE if torch.device(device).type == "cpu" else GPU_TOLERANCE


def row_bound(want: torch.Tensor, device: str) -> torch.Tensor:
    """float64 ``[rows]``: each row's exactness bound, :func:`tolerance` times the row's
    largest |HF logit| where that exceeds 1."""
    scale = want.abs().amax(-1).double()
    return tolerance(device) * torch.where(torch.isfinite(scale), scale.clamp(min=1.0), 1.0)


HALF_RATIO = 2.0
"""A half-precision check (``dtype="bfloat16"`` or ``"float16"``) verifies in that dtype and
judges against the float32 forward of the same weights: it is exact when every row's largest
error is at most this multiple of HF's own forward's in that dtype on that row (plus
:data:`HALF_FLOOR`). Rounding at other points than HF (a norm or activation fused in float32,
another summation order) moves a half-precision logit by as much as HF's own rounding does; a
wrong mask, a lost term or a misplaced head moves it by far more."""

HALF_FLOOR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
"""Absolute slack of a half-precision judgement: about 4 rounding steps of a logit of order 1
(2**-8 in bfloat16, 2**-11 in float16)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The zoo's verify dtypes; the half-precision ones are judged as :data:`HALF_RATIO` says."""

SLOTS = (2, 0, 1)
PROMPTS = (10, 7, 12)
ROUNDS = (((3, 1, 4), (2, 1, 3)),   # (draft lengths, accepted prefix) per request
          ((2, 4, 1), (1, 4, 1)),
          ((4, 2, 3), (4, 1, 2)))
"""Request geometry: prompts ~10 tokens, then three rounds; every sequence ends past the tiny
sliding window (8)."""

_REFUSALS = (NotImplementedError, TypeError, ValueError)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ZOO = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclass(frozen=True)
class Entry:
    """One row of the zoo: a model type, its causal-LM class and the config fields a variant
    sets on top of the tiny rules."""

    model_type: str
    architecture: str
    variant: str = ""
    overrides: tuple = ()

    @property
    def name(self) -> str:
        return f"{self.model_type}+{self.variant}" if self.variant else self.model_type


def entries() -> list[Entry]:
    """Every ``*ForCausalLM`` model type of the installed transformers
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) and every multimodal language model that is not one
    (``MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES`` and ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``:
    LLaVA, Qwen-VL, Mistral 3, the speech LMs, ...; verified on text, as every verify step
    is), plus a ``+window`` variant of each config class that has a ``use_sliding_window``
    switch defaulting to off (Qwen2's family: its window is exercised only when switched
    on)."""
    import dataclasses

    from transformers.models.auto import modeling_auto as auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    models = {**getattr(auto, "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", {}),
              **getattr(auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}), **causal}
    out = []
    for model_type, arch in sorted(models.items()):
        out.append(Entry(model_type, arch))
        if model_type not in CONFIG_MAPPING_NAMES:
            continue
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            fields = {f.name: f for f in dataclasses.fields(CONFIG_MAPPING[model_type])}
        except Exception:  # noqa: BLE001 - not a dataclass config or import fails: no variant
            continue
        switch = fields.get("use_sliding_window")
        if switch is not None and switch.default is False and "sliding_window" in fields:
            out.append(Entry(model_type, arch, "window",
                             (("use_sliding_window", True), ("sliding_window", 8))))
    return out


@dataclass
class Result:
    """One architecture's outcome (a row of the zoo's table and JSON)."""

    name: str
    model_type: str
    architecture: str
    status: str
    reason: str = ""
    max_error: float | None = None
    flipped: float | None = None
    """Fraction of verified rows whose greedy token differs from HF's (``wrong`` rows)."""
    rows: int = 0
    """Verified rows compared."""
    layers: int | None = None
    layer_kinds: str = ""
    """``covered/kinds``: layer kinds of the default config the tiny one has."""
    reference: str = ""
    """HF attention implementation of the reference forward."""
    tie_rows: int | None = None
    """Rows past the bound that HF's own forwards move as far: over the same tokens cut short
    or through its cache (:func:`_equivalent_errors`: an exact tie the model breaks by the
    sequence's length), and in half precision under rounding-sized input noise
    (:func:`_perturbed_errors`: a near-tied discrete choice, an expert); not counted in
    ``off_rows``. Set for every half-precision check, and for a float32 one with such rows."""
    off_rows: int | None = None
    """Verified rows beyond the bound (float32: :func:`tolerance`; half precision: that row's HF
    error in that dtype times :data:`HALF_RATIO` plus the dtype's :data:`HALF_FLOOR`)."""
    hf_error: float | None = None
    """Half-precision checks: the largest |HF's forward in that dtype - its float32 forward|
    (``max_error`` is then the verifier's against the float32 forward)."""
    decode_error: float | None = None
    """float32 checks: the largest |HF's own one-token cached decoding - its forward over the
    same tokens| of a request's final sequence (:func:`_decode_errors`); None where the model's
    cache path fails. A model whose decoding is not its forward is ``wrong`` however exactly the
    verifier matches the forward."""
    decode_rows: int | None = None
    """Of those rows, how many are beyond the exactness bound."""
    message: str = ""
    """The whole exception text (refused / error rows)."""
    where: str = ""
    """Where the exception was raised: the innermost frame, and the innermost dspark_compile
    frame when that differs."""
    seconds: float = 0.0
    phase: str = ""
    """The step that ended the check: config, model, reference, compile, verify, done."""
    config: dict = field(default_factory=dict)
    """Fields the tiny rules rewrote: ``{field: [default, tiny]}``."""

    def to_json(self) -> dict:
        return asdict(self)


def _enter(result: Result, phase: Callable[[str], None], step: str) -> None:
    result.phase = step
    phase(step)


def _first_line(text: str) -> str:
    """The message's first line, with the next one when it ends in a colon (a validation
    error whose cause follows)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


def _frames(err: BaseException) -> tuple[str, str]:
    """``(innermost frame, innermost dspark_compile frame)`` as ``path:line``."""
    frames = traceback.extract_tb(err.__traceback__)

    def short(f):
        path = f.filename
        for marker in ("site-packages" + os.sep, _PACKAGE):
            if marker in path:
                path = path.split(marker, 1)[1] if marker != _PACKAGE else \
                    "dspark_compile/" + path.split(marker, 1)[1]
        return f"{path}:{f.lineno}"
    inner = short(frames[-1]) if frames else ""
    ours = next((short(f) for f in reversed(frames)
                 if f.filename.startswith(_PACKAGE) and not f.filename.startswith(_ZOO)), "")
    return inner, ours


def classify(err: BaseException) -> tuple[str, str, str]:
    """``(status, reason, where)`` of an exception raised by ``dspark_compile``, ``new_state``,
    a verify or a commit. ``refused``: a :class:`~dspark_compile.RefusedOp` or
    :class:`~dspark_compile.HookedModelError`, or a
    NotImplementedError / TypeError / ValueError raised by the library's own code (not one that
    escaped from torch or transformers through it); everything else is ``error``."""
    from ..passes import RefusedOp
    from ..session import HookedModelError

    inner, ours = _frames(err)
    where = inner if not ours or ours == inner else f"{inner} (via {ours})"
    message = _first_line(str(err)) or type(err).__name__
    own = bool(inner) and inner.startswith("dspark_compile/") and \
        not inner.startswith("dspark_compile/zoo/")
    if isinstance(err, (RefusedOp, HookedModelError)) or (isinstance(err, _REFUSALS) and own):
        return "refused", message, where
    return "error", f"{type(err).__name__}: {message}", where


def _hf_logits(model, seq: torch.Tensor) -> torch.Tensor:
    """HF's logits over ``seq`` as ``generate`` calls the model: with an all-ones attention
    mask. Without one some models build no mask at all, and their eager attention then sees
    every token (transformers 5.17's Moshi), which no causal decoder is."""
    with torch.no_grad():
        return model(input_ids=seq[None], attention_mask=torch.ones_like(seq[None]),
                     use_cache=False).logits[0].float()


def _equivalent_errors(model, seq: torch.Tensor, n: int, want: torch.Tensor,
                       chunks: list[int] | None = None,
                       steps: list[tuple[torch.Tensor, int]] | None = None) -> torch.Tensor:
    """float64 ``[n]``: the largest error against ``want`` (HF's logits of ``seq``'s last ``n``
    rows over the whole of ``seq``) of HF's own forwards that a causal model must agree with:
    each row's forward over ``seq`` cut right after it, the rows' forward through HF's cache
    after calls over the tokens before them in ``chunks`` (their lengths; default one call), as
    ``generate`` runs a chunk, and (``steps``: each earlier verify step's tokens, drafts
    included, and how many of them were accepted) through a cache that ran every step whole and
    was cropped to its accepted tokens, as speculative decoding runs the model; each left out
    where the model's cache path fails. A row where these differ is one the model itself leaves
    open: an exact tie (two top-k scores both zero after a ReLU) that its top-k breaks by the
    sequence's length, so no implementation can match every one of HF's forwards."""
    worst = torch.zeros(n, dtype=torch.float64)

    def take(alt: torch.Tensor, rows: slice) -> None:
        diff = (alt.float().cpu() - want[rows]).abs().double().amax(-1)
        worst[rows] = torch.maximum(worst[rows], torch.nan_to_num(diff, nan=0.0))

    total = seq.numel()
    for j in range(n - 1):  # the last row's cut forward is the whole sequence's
        take(_hf_logits(model, seq[:total - n + j + 1])[-1:], slice(j, j + 1))
    # the cache's keyword: ``cache`` where the forward takes it (DeepSeek-V4), else the older
    # ``past_key_values``
    key = ("cache" if "cache" in inspect.signature(model.forward).parameters
           else "past_key_values")

    def through_cache(calls: list[tuple[torch.Tensor, int]]) -> None:
        """HF over ``calls`` (tokens, how many to keep) then the last ``n`` rows, one cache."""
        try:
            with torch.no_grad():
                cache, start = None, 0
                for tokens, keep in calls + [(seq[total - n:], n)]:
                    tokens = tokens.to(seq.device)
                    out = model(input_ids=tokens[None],
                                attention_mask=torch.ones(1, start + tokens.numel(),
                                                          dtype=seq.dtype, device=seq.device),
                                use_cache=True, **{key: cache})
                    cache = out.past_key_values
                    if keep < tokens.numel():  # a negative count: drop that many (5.17 and on)
                        cache.crop(keep - tokens.numel())
                    for layer in getattr(cache, "layers", ()):  # sliding layers keep what a
                        record = getattr(layer, "activate_past_recording", None)  # crop needs
                        if record is not None:
                            record()
                    start += keep
            take(out.logits[0, -n:], slice(0, n))
        except Exception:  # noqa: BLE001 - a model without a usable cache path: the cuts only
            pass

    pieces = [c for c in (chunks or [total - n]) if c > 0]
    if total > n and sum(pieces) == total - n:
        bounds = [0, *torch.tensor(pieces).cumsum(0).tolist()]
        through_cache([(seq[a:b], b - a) for a, b in zip(bounds, bounds[1:])])
    if steps and sum(keep for _, keep in steps) == total - n and \
            any(keep < tokens.numel() for tokens, keep in steps):
        through_cache(list(steps))
    return worst


DECODE_PREFILL = 4
"""Tokens :func:`_decode_errors` prefills before decoding one token a call."""


def _decode_errors(model, seq: torch.Tensor, prefill: int,
                   device: str) -> tuple[float, int] | None:
    """``(largest error, rows beyond row_bound)`` of HF's own decoding of ``seq``: ``generate``
    over its first ``prefill`` tokens, greedy, each next token forced to ``seq``'s, its raw
    logits at each step against the model's forward over the same tokens (each row's forward
    over ``seq`` cut right after it, so a tie the model breaks by the sequence's length breaks
    alike); None where ``generate`` fails. A model whose cache keeps less than its forward reads
    (a sliding-window cache under a plain causal mask) or approximates it decodes otherwise
    than it forwards, and no verify can match both."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = torch.full_like(scores, float("-inf"))
            out[:, seq[input_ids.shape[-1]]] = 0.0
            return out

    worst, off = 0.0, 0
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=seq[None, :prefill], attention_mask=torch.ones_like(seq[None, :prefill]),
                max_new_tokens=seq.numel() - prefill, min_new_tokens=seq.numel() - prefill,
                do_sample=False, num_beams=1, use_cache=True,
                logits_processor=LogitsProcessorList([Forced()]), output_logits=True,
                return_dict_in_generate=True, pad_token_id=int(seq[0]))
        if not torch.equal(out.sequences[0].cpu(), seq.cpu()):
            return None
        for j, logits in enumerate(out.logits):
            got = logits[:1].float().cpu()
            want = _hf_logits(model, seq[:prefill + j])[-1:].cpu()
            err = (got - want).abs().double().amax(-1)
            worst = max(worst, float(err.max()))
            off += int((~(err <= row_bound(want, device))).sum())
    except Exception:  # noqa: BLE001 - a model generate cannot run
        return None
    return worst, off


PERTURB_TRIALS = 8
"""HF half-precision forwards :func:`_perturbed_errors` runs for a request with a row past the
bound."""

PERTURB_SCALE = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
"""Relative noise on the embedding rows: the half dtype's rounding step."""


def _perturbed_errors(half, seq: torch.Tensor, n: int, want: torch.Tensor,
                      seed: int) -> torch.Tensor:
    """float64 ``[n]``: the largest error against ``want`` (float32 logits of ``seq``'s last
    ``n`` rows) of HF's half-precision forward over :data:`PERTURB_TRIALS` copies whose
    embedding rows carry relative noise of the dtype's :data:`PERTURB_SCALE`. A row only
    rounding at other points moves by HF's usual error; a row near a discrete choice (two
    experts' scores within rounding) moves as far as a flipped choice does, in HF's own forward
    as in ours."""
    embed = half.get_input_embeddings().weight
    saved = embed.detach().clone()
    gen = torch.Generator().manual_seed(seed + 7)
    worst = torch.zeros(n, dtype=torch.float64)
    try:
        for _ in range(PERTURB_TRIALS):
            noise = torch.randn(saved.shape, generator=gen).to(saved.device, saved.dtype)
            with torch.no_grad():
                embed.copy_(saved + saved * noise * PERTURB_SCALE[saved.dtype])
            diff = (_hf_logits(half, seq)[-n:].cpu() - want).abs().double().amax(-1)
            worst = torch.maximum(worst, torch.nan_to_num(diff, nan=0.0))
    finally:
        with torch.no_grad():
            embed.copy_(saved)
    return worst


def _reference_model(model_cls, config, impl: str, seed: int, result: Result, phase,
                     device: str = "cpu"):
    """The tiny model (seeded on the host, float32, eval, moved to ``device``) with HF attention
    ``impl``, and the token ids the check may draw (the vocabulary without special tokens); its
    forward must give finite logits for every position."""
    _enter(result, phase, "model")
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=impl,
                                   dtype=torch.float32).eval().to(device)
    vocab = model.get_input_embeddings().num_embeddings
    allowed = torch.tensor(sorted(set(range(vocab)) - config_token_ids(config.to_dict())))
    probe = allowed[torch.randint(0, allowed.numel(), (24,),  # the longest check sequence: 19
                                  generator=torch.Generator().manual_seed(seed))].to(device)
    _enter(result, phase, "reference")
    logits = _hf_logits(model, probe)
    if logits.shape[0] != probe.numel() or not torch.isfinite(logits).all():
        raise ValueError(f"HF logits {tuple(logits.shape)} for {probe.numel()} tokens, finite: "
                         f"{bool(torch.isfinite(logits).all())}")
    return model, allowed


def check(entry: Entry, phase: Callable[[str], None] = lambda _: None,
          seed: int = 0, device: str = "cpu", dtype: str = "float32",
          static: bool = False) -> Result:
    """Build, compile and verify ``entry`` on ``device`` (HF's forward and the verifier on the
    same device: on a GPU the verifier's Triton lowering) in ``dtype`` (``"bfloat16"`` or
    ``"float16"``: the float32 model cast, judged by :data:`HALF_RATIO`); ``static``: through
    the tier session (``Verifier.capture``: static buffers padded to each tier on the CPU, CUDA
    graphs on a GPU; the prompts, past the largest tier, run without it). Never raises once
    ``dtype`` is one of :data:`DTYPES` (the outcome is the result)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; the zoo verifies in {sorted(DTYPES)}")
    start = time.perf_counter()
    result = Result(entry.name, entry.model_type, entry.architecture, "skipped")
    try:
        _run(entry, result, phase, seed, device, dtype, static)
    except _Stop:
        pass
    result.seconds = round(time.perf_counter() - start, 2)
    return result


class _Stop(Exception):
    pass


def _skip(result: Result, step: str, err: BaseException):
    result.status = "skipped"
    result.phase = step
    inner, _ = _frames(err)
    result.reason = f"{step}: {type(err).__name__}: {_first_line(str(err)) or repr(err)}"
    result.message = str(err)[:4000]
    result.where = inner
    raise _Stop


def _fail(result: Result, step: str, err: BaseException):
    result.status, result.reason, result.where = classify(err)
    result.phase = step
    result.message = str(err)[:4000]
    raise _Stop


def _run(entry: Entry, result: Result, phase, seed: int, device: str,
         dtype: str = "float32", static: bool = False) -> None:
    import transformers

    from ..layout import VerifyLayout
    from ..verifier import dspark_compile

    _enter(result, phase, "config")
    try:
        model_cls = getattr(transformers, entry.architecture)
        tiny = tiny_config(entry.model_type, model_cls, dict(entry.overrides))
    except Exception as err:  # noqa: BLE001 - every failure is a row
        _skip(result, "config", err)
    result.config = {k: [a, b] for k, (a, b) in tiny.changed.items()}
    text = tiny.config.get_text_config()
    result.layers = getattr(text, "num_hidden_layers", None) or tiny.layers
    result.layer_kinds = f"{tiny.covered}/{tiny.kinds}"

    failures = []
    for impl in ("eager", "sdpa"):  # sdpa only where HF's own eager path fails
        try:
            model, allowed = _reference_model(model_cls, tiny.config, impl, seed, result, phase,
                                              device)
            result.reference = impl
            break
        except Exception as err:  # noqa: BLE001
            failures.append(("HF model" if result.phase == "model" else "HF forward", err))
    else:
        _skip(result, *failures[0])

    half, half_dtype = None, DTYPES[dtype]
    if dtype != "float32":  # the same weights cast; float32 stays the judge
        try:
            half = copy.deepcopy(model).to(half_dtype)
            _hf_logits(half, allowed[:4].to(device))
        except Exception as err:  # noqa: BLE001
            _skip(result, "HF forward", err)

    _enter(result, phase, "compile")
    try:
        verifier = dspark_compile(model if half is None else half)
    except Exception as err:  # noqa: BLE001
        _fail(result, "compile", err)

    _enter(result, phase, "verify")
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(n):
        return allowed[torch.randint(0, allowed.numel(), (n,), generator=gen)]

    worst, hf_worst, flipped, rows, off, ties = 0.0, 0.0, 0, 0, 0, 0

    def row_errors(a, b) -> torch.Tensor:
        """float64 [rows]: each row's largest |a - b| (inf where any is not finite)."""
        diff = (a - b).abs().double()
        return torch.where(torch.isfinite(diff).all(-1), diff.amax(-1), float("inf"))

    try:
        state = verifier.new_state(max_requests=max(SLOTS) + 1, max_context=64)
        if static:
            verifier.capture(state, progress=False)
        seqs = [torch.empty(0, dtype=torch.int64) for _ in SLOTS]
        pieces = [[] for _ in SLOTS]  # each request's committed chunks, as the verifier took them
        history = [[] for _ in SLOTS]  # each request's verify steps: (tokens, accepted)
        steps = [(PROMPTS, PROMPTS)] + [tuple(r) for r in ROUNDS]
        for lens, accept in steps:
            new = [draw(n) for n in lens]
            layout = VerifyLayout.pack(list(lens), [s.numel() for s in seqs], list(SLOTS))
            out = verifier(torch.cat(new).to(device), layout, state).float().cpu()
            qsl = layout.query_start_loc.tolist()
            for i, n in enumerate(lens):
                got = out[qsl[i]:qsl[i + 1]]
                want = _hf_logits(model, torch.cat([seqs[i], new[i]]).to(device))[-n:].cpu()
                if got.shape != want.shape:
                    raise AssertionError(f"ragged logits {tuple(got.shape)} vs HF "
                                         f"{tuple(want.shape)}")
                err = row_errors(got, want)  # [n]
                seq = torch.cat([seqs[i], new[i]]).to(device)
                if half is None:
                    bound = row_bound(want, device)
                else:  # each row against HF's own rounding of that row
                    hf_err = row_errors(_hf_logits(half, seq)[-n:].cpu(), want)
                    hf_worst = max(hf_worst, float(hf_err.max()))
                    bound = HALF_RATIO * hf_err + HALF_FLOOR[half_dtype]
                beyond = ~(err <= bound)
                if beyond.any():  # rows HF's own forwards also move that far: ties
                    moved = _equivalent_errors(model if half is None else half, seq, n, want,
                                               pieces[i], history[i])
                    if half is not None:  # and under rounding-sized noise
                        moved = torch.maximum(moved, _perturbed_errors(half, seq, n, want, seed))
                    tie = beyond & torch.isfinite(err) & (moved >= err / HALF_RATIO)
                    ties += int(tie.sum())
                    bound = torch.where(tie, err, bound)
                worst = max(worst, float(err.max()))
                off += int((~(err <= bound)).sum())
                flipped += int((got.argmax(-1) != want.argmax(-1)).sum())
                rows += n
            verifier.commit(layout, list(accept), state)
            seqs = [torch.cat([s, t[:a]]) for s, t, a in zip(seqs, new, accept)]
            pieces = [p + [a] for p, a in zip(pieces, accept)]
            history = [h + [(t.cpu(), a)] for h, t, a in zip(history, new, accept)]
    except Exception as err:  # noqa: BLE001
        result.max_error, result.rows = (worst if rows else None), rows
        _fail(result, "verify", err)
    if half is None:
        decoded = _decode_errors(model, seqs[0].to(device), DECODE_PREFILL, device)
        if decoded is not None:
            result.decode_error, result.decode_rows = decoded
    result.phase = "done"
    result.max_error, result.rows = worst, rows
    result.flipped = flipped / rows if rows else None
    result.off_rows = off
    if half is not None:
        result.hf_error = hf_worst
    if half is not None or ties:
        result.tie_rows = ties
    if result.decode_rows:
        result.status = "wrong"
        result.reason = (f"HF's own one-token cached decoding differs from its forward over the "
                         f"same tokens at {result.decode_rows} rows (by {result.decode_error:.3g}"
                         "): the model's decoding is not its forward, which the verifier "
                         "matches")
    elif off == 0:
        result.status = "exact"
    else:
        result.status = "wrong"
        what = "HF" if half is None else "HF float32"
        result.reason = (f"max |ragged - {what}| = {worst:.3g}"
                         + (f" (HF's own {dtype}: {hf_worst:.3g})" if half is not None else "")
                         + f"; {off} of {rows} rows off, {flipped} greedy tokens flipped "
                         f"({flipped / rows:.0%})")
    if ties:
        how = ("over the same tokens cut short, through its cache, or through a cache cropped "
               "to each verify step's accepted tokens")
        how = (f"under rounding-sized noise, or {how}" if half is not None
               else f"{how}: a tie its top-k breaks by the sequence's length")
        result.reason = (f"{ties} of {rows} rows at near-ties (HF's own {dtype} forward moves "
                         f"them as far {how})"
                         + (f"; {result.reason}" if result.reason else ""))
