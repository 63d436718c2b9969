"""Hugging Face ``generate()`` verifying through a compiled verifier.

transformers' assisted generation (``prompt_lookup_num_tokens=k``, ``assistant_model=...``)
drafts candidates, runs the target's forward over ``[last token, candidates]`` with a cache, picks
the accepted prefix itself (greedy match, or speculative sampling when the assistant gives
logits) and then calls ``cache.crop(-rejected)``. Plain ``generate`` runs the same forward one
token at a time and never crops. So two things are enough to put a compiled verifier under
HF's own loop, sampler and stopping criteria, untouched:

- :class:`DSparkCache`, a ``transformers.Cache`` over one slot of a :class:`VerifierState`. It
  holds no tensors: the verifier's paged pool does. A forward's rows are *pending* until the
  next call on the cache: ``crop(-n)`` commits all but the last ``n`` of them
  (``verifier.commit`` with ``accept_lens = [T - n]``), and a forward with rows still pending
  (plain decoding, which never crops) commits them all first.
- a forward that packs the new tokens into a one-request :class:`VerifyLayout` over the
  committed context and returns the verifier's logits. :meth:`DSparkGeneration.attached`
  installs it on the model instance for the duration of a ``with`` block, and it takes over
  only the calls that carry a :class:`DSparkCache` (an assistant that is the model itself, or
  any other call, runs HF's forward as before).

Because HF's loop picks the tokens from logits that equal its own forward's (to float32
rounding: about 1e-4 on SmolLM2's logits of about 38), ``generate`` through the adapter decodes
the same tokens as plain ``generate`` under greedy decoding, and under sampling draws from the
same distribution with the same random numbers (so a fixed seed gives HF's own tokens).

Hybrid models (linear-attention layers with recurrent state; tested on Qwen3.5) verify too:
HF refuses assisted generation for them because their own cache cannot roll back, but a
``DSparkCache``'s can (the verifier replays each layer's kept prefix), so while attached the
model instance reports ``_is_stateful = False`` and prompt lookup runs on them.

What is refused, with the reason: a cache of HF's own (``cache=`` / ``past_key_values=``; the
adapter brings its own), beam search (``num_beams > 1``: the verifier's slots do not fork), a
batch of more than one sequence or a padded one (HF's assisted loop is batch size 1; so is the
adapter), ``inputs_embeds``, forward options that need what the verifier does not compute
(``output_attentions``, ``output_hidden_states``: an assistant such as an MTP head that reads
the target's hidden states), and any forward keyword outside the ones the adapter reads.

Use::

    from dspark_compile.integrations.transformers import DSparkGeneration

    gen = DSparkGeneration(model)          # compiles the model (or pass verifier=...)
    out = gen.generate(input_ids, prompt_lookup_num_tokens=4, max_new_tokens=64)
    out = gen.generate(input_ids, assistant_model=small, max_new_tokens=64, do_sample=True)

    with gen.attached():                   # a client that calls model.generate itself
        out = model.generate(input_ids, cache=gen.new_cache(), prompt_lookup_num_tokens=4)

A cache kept across calls carries a conversation: plain ``generate`` over the whole sequence
verifies only what the cache does not hold yet. HF's assisted generation re-feeds the whole
sequence on its first step, so it needs a new cache (it is refused over a non-empty one).

On a GPU the state's token tiers are captured as CUDA graphs (``capture=True``), so each
verify replays a graph; a step larger than the largest tier (a long prompt's prefill) runs
without one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any

import torch
from transformers import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..layout import VerifyLayout
from ..verifier import Verifier, dspark_compile

log = logging.getLogger("dspark_compile")

DEFAULT_MAX_CONTEXT = 2048
"""``DSparkGeneration``'s ``max_context`` when none is given and the model's positions allow."""

__all__ = ["DSparkCache", "DSparkGeneration", "UnsupportedGenerationError"]


_UNSET = object()


class UnsupportedGenerationError(ValueError):
    """A ``generate`` option or forward input the adapter does not support (see the module
    docstring); the message names it and says why."""


# Forward keywords the adapter reads; any other keyword must be None (or False).
_READ = {"input_ids", "attention_mask", "position_ids", "cache", "past_key_values",
         "use_cache", "logits_to_keep", "return_dict"}
# Keywords HF may pass that are harmless when None / False.
_FALSY_OK = {"inputs_embeds", "labels", "output_attentions", "output_hidden_states",
             "token_type_ids", "cache_position"}


class DSparkCache(Cache):
    """A ``transformers.Cache`` over one slot of a verifier's state (see the module docstring).

    ``get_seq_length()`` counts committed and pending rows, as HF's caches count every row a
    forward wrote until ``crop`` drops some. ``close()`` gives the slot back (``generate`` of
    :class:`DSparkGeneration` does it when it returns)."""

    def __init__(self, owner: "DSparkGeneration", slot: int) -> None:
        super().__init__(layers=[])
        self.owner, self.slot = owner, slot
        self.committed = 0
        """Tokens committed to the slot."""
        self._pending: VerifyLayout | None = None
        self._pending_len = 0
        self.closed = False
        self.steps = 0
        """Forwards run through the verifier (a prefill and every verify step)."""
        self.verified_tokens = 0
        """Rows those forwards ran (prompt tokens included)."""

    # ------------------------------------------------------------------ what HF reads
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.committed + self._pending_len

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length()

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.owner.state.max_context

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` rows of the last forward and commit the rest
        (HF's convention: a non-positive count; ``crop(0)`` commits every pending row)."""
        self._check_open()
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or \
                tokens_to_remove > 0:
            raise ValueError(f"DSparkCache.crop({tokens_to_remove!r}): pass a negative int, the "
                             "number of rows to drop, or 0 (HF's Cache.crop convention)")
        drop = -tokens_to_remove
        if drop > self._pending_len:
            raise ValueError(f"DSparkCache.crop({tokens_to_remove}): only the last forward's "
                             f"{self._pending_len} rows can be dropped; the {self.committed} "
                             "before them are committed to the verifier's state")
        self._commit(self._pending_len - drop)

    def reset(self) -> None:
        """Forget every row (the slot is released and taken again)."""
        self._check_open()
        self._pending, self._pending_len = None, 0
        self.owner.state.release([self.slot])
        self.committed = 0

    def activate_past_recording(self) -> None:  # rows stay provisional until crop anyway
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedGenerationError("DSparkCache: beam search reorders the cache; the "
                                         "verifier's slots do not fork (use num_beams=1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedGenerationError(
                f"DSparkCache: generate asked for {repeats} copies of the sequence "
                "(num_return_sequences or beams); the adapter decodes one (pass 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedGenerationError("DSparkCache: selecting batch rows is not supported "
                                         "(the adapter decodes one sequence)")

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return False  # HF must not wrap the forward in torch.compile: the verifier is compiled

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def is_linear(self) -> list[bool]:
        return [False]  # it tracks a sequence length, as an attention cache does

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]

    @property
    def batch_size(self) -> int:
        return 1

    # ------------------------------------------------------------------ the verifier side
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("DSparkCache: this cache was closed (its slot was given back); "
                               "take a new one with DSparkGeneration.new_cache()")

    def _commit(self, keep: int) -> None:
        if self._pending is None:
            return
        layout, self._pending, self._pending_len = self._pending, None, 0
        self.owner.verifier.commit(layout, [keep], self.owner.state)
        self.committed += keep

    def settle(self) -> None:
        """Commit every pending row (what a forward with rows pending does first)."""
        self._commit(self._pending_len)

    def verify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, V]`` of ``tokens [T]`` after the committed context; the rows stay
        pending until :meth:`crop` or the next call. More tokens than the state's
        ``max_step_tokens`` (a long prompt) run in chunks: all but the last are committed as
        they go, so only the last chunk's rows can be cropped."""
        self._check_open()
        self.settle()
        t = tokens.numel()
        if self.committed + t > self.owner.state.max_context:
            raise UnsupportedGenerationError(
                f"DSparkCache: {self.committed} committed + {t} new tokens exceed the state's "
                f"max_context={self.owner.state.max_context}; make DSparkGeneration with a "
                "larger max_context (or lower max_new_tokens)")
        bound = self.owner.state.max_step_tokens or t
        done, chunks = 0, []
        while t - done > bound:  # a copy: after capture the output is a static buffer
            layout = VerifyLayout.pack([bound], [self.committed], [self.slot])
            chunks.append(self.owner.verifier(tokens[done:done + bound], layout,
                                              self.owner.state).clone())
            self.owner.verifier.commit(layout, [bound], self.owner.state)
            self.committed += bound
            done += bound
            self.steps += 1
        layout = VerifyLayout.pack([t - done], [self.committed], [self.slot])
        logits = self.owner.verifier(tokens[done:], layout, self.owner.state)
        self._pending, self._pending_len = layout, t - done
        self.steps += 1
        self.verified_tokens += t
        return torch.cat(chunks + [logits]) if chunks else logits

    def close(self) -> None:
        """Give the slot back (idempotent)."""
        if not self.closed:
            self.closed = True
            self._pending, self._pending_len = None, 0
            self.owner._give_back(self.slot)


class DSparkGeneration:
    """``model.generate`` over a compiled verifier (see the module docstring).

    ``verifier``: ``dspark_compile(model)`` when None (``compile_options`` go to it);
    ``max_context``: tokens one sequence may hold (prompt, output and one draft block; default
    :data:`DEFAULT_MAX_CONTEXT`, or fewer where the model's position table serves fewer: one log
    line says so); ``max_requests``: caches that may be open at once (one per ``generate`` call
    in flight); ``capture``: capture tier graphs for up to ``block`` tokens a step (default: on
    a GPU)."""

    def __init__(self, model, verifier: Verifier | None = None, *,
                 max_context: int | None = None,
                 max_requests: int = 1, capture: bool | None = None, block: int | None = None,
                 **compile_options: Any) -> None:
        if getattr(model.config, "is_encoder_decoder", False):
            raise UnsupportedGenerationError(
                f"DSparkGeneration: {type(model).__name__} is an encoder-decoder; the verifier "
                "compiles decoder-only causal LMs")
        self.model = model
        self.verifier = verifier if verifier is not None else dspark_compile(model,
                                                                             **compile_options)
        if max_context is None:
            max_context = DEFAULT_MAX_CONTEXT
            limit = self.verifier.position_limit
            if limit is not None and limit.positions < max_context:
                max_context = limit.positions
                log.info("DSparkGeneration: max_context %d, %s (the default is %d)", max_context,
                         limit.reason(), DEFAULT_MAX_CONTEXT)
        self.state = self.verifier.new_state(max_requests=max_requests, max_context=max_context)
        self._free = list(range(max_requests))
        self._lock = threading.Lock()
        if capture is None:
            capture = self.verifier.device.type == "cuda"
        self.session = self.verifier.capture(self.state, block=block) if capture else None
        self._depth = 0
        self._hf_forward = None

    # ------------------------------------------------------------------ caches
    def new_cache(self) -> DSparkCache:
        """A cache over a free slot; ``close()`` it when done (``generate`` does)."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"DSparkGeneration: all {self.state.max_requests} slots are "
                                   "in use; close a cache or make the adapter with a larger "
                                   "max_requests")
            slot = self._free.pop(0)
        return DSparkCache(self, slot)

    def _give_back(self, slot: int) -> None:
        self.state.release([slot])
        with self._lock:
            self._free.append(slot)

    # ------------------------------------------------------------------ routing
    @contextlib.contextmanager
    def attached(self):
        """Within the block, the model's forward runs through the verifier whenever it is
        given a :class:`DSparkCache` (and HF's forward otherwise)."""
        with self._lock:
            if self._depth == 0:
                hf_forward = self.model.forward  # the bound method (or someone's override)

                @functools.wraps(hf_forward)
                def forward(*args, **kwargs):
                    cache = kwargs.get("cache", kwargs.get("past_key_values"))
                    if isinstance(cache, DSparkCache):
                        return self._forward(cache, args, kwargs)
                    return hf_forward(*args, **kwargs)

                forward.dspark_route = True  # the build's hook check knows it as ours
                self._hf_forward = hf_forward
                self.model.forward = forward
                # HF refuses assisted generation for models with recurrent state, which cannot
                # roll back; through a DSparkCache they can (the verifier replays the kept
                # prefix of every linear-attention layer), so the instance says so meanwhile
                self._stateful = self.model.__dict__.get("_is_stateful", _UNSET)
                if getattr(self.model, "_is_stateful", False):
                    self.model._is_stateful = False
            self._depth += 1
        try:
            yield self
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    if self.model.__dict__.get("forward") is not None:
                        del self.model.forward  # back to the class's (or what was there)
                    if self._hf_forward is not None and \
                            getattr(self._hf_forward, "__self__", None) is not self.model:
                        self.model.forward = self._hf_forward  # an instance override before us
                    self._hf_forward = None
                    if self._stateful is _UNSET:
                        self.model.__dict__.pop("_is_stateful", None)
                    else:
                        self.model._is_stateful = self._stateful

    def _forward(self, cache: DSparkCache, args: tuple, kwargs: dict) -> CausalLMOutputWithPast:
        if args:
            raise UnsupportedGenerationError(
                f"DSparkGeneration: the forward got {len(args)} positional argument(s); "
                "generate passes keywords only (input_ids=..., cache=...)")
        for key, value in kwargs.items():
            if key in _READ:
                continue
            if key in _FALSY_OK and (value is None or value is False):
                continue
            raise UnsupportedGenerationError(
                f"DSparkGeneration: forward keyword {key}={_short(value)} is not supported; the "
                "verifier computes logits from token ids only (no embeddings, attentions or "
                "hidden states; an assistant that reads the target's hidden states cannot run)")
        if kwargs.get("use_cache") is False:
            raise UnsupportedGenerationError("DSparkGeneration: use_cache=False; the verifier "
                                             "always decodes over its cache")
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or \
                ids.shape[1] < 1:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise UnsupportedGenerationError(
                f"DSparkGeneration: input_ids {shape}; the adapter decodes one sequence, "
                "input_ids [1, T] (batch size 1, as HF's assisted generation)")
        past, t = cache.get_seq_length(), ids.shape[1]
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            if mask.dim() != 2 or mask.shape[-1] != past + t or not bool(mask.all()):
                raise UnsupportedGenerationError(
                    f"DSparkGeneration: attention_mask of shape {tuple(mask.shape)} with "
                    f"{int((mask == 0).sum())} masked positions; the adapter needs an unpadded "
                    f"[1, {past + t}] mask of ones (no padding)")
        elif mask is not None:
            raise UnsupportedGenerationError(f"DSparkGeneration: attention_mask is a "
                                             f"{type(mask).__name__}; pass a [1, L] tensor")
        pos = kwargs.get("position_ids")
        if pos is not None:
            want = torch.arange(past, past + t, device=pos.device)
            if pos.numel() != t or not torch.equal(pos.reshape(-1), want):
                if past and pos.numel() and int(pos.reshape(-1)[0]) == 0:
                    raise UnsupportedGenerationError(
                        f"DSparkGeneration: the forward re-feeds the whole sequence ({t} tokens "
                        f"from position 0) over a cache that holds {past}: HF's assisted "
                        "generation does so on its first step. Continue a conversation in a "
                        "cache with plain generate, or give assisted generate a new cache")
                raise UnsupportedGenerationError(
                    "DSparkGeneration: position_ids are not the positions after the cache "
                    f"({past}..{past + t - 1}); the verifier places tokens by the cache length")
        logits = cache.verify(ids[0].to(self.verifier.device))
        keep = kwargs.get("logits_to_keep") or 0
        if isinstance(keep, torch.Tensor) or not isinstance(keep, int) or keep < 0:
            raise UnsupportedGenerationError(f"DSparkGeneration: logits_to_keep={keep!r}; pass "
                                             "an int >= 0 (0: every row)")
        if keep:
            logits = logits[-keep:]
        # a copy: after capture the verifier's logits are a view of a static buffer that the
        # next verify overwrites, and HF keeps the last outputs across a step
        return CausalLMOutputWithPast(logits=logits.clone()[None], cache=cache)

    # ------------------------------------------------------------------ generate
    def generate(self, input_ids: torch.Tensor | None = None, **kwargs):
        """``model.generate(input_ids, **kwargs)`` verifying through the verifier: a fresh
        :class:`DSparkCache` for the call, closed when it returns. Everything ``generate``
        takes passes through, except what the module docstring lists as refused."""
        for key in ("cache", "past_key_values"):
            if kwargs.get(key) is not None:
                raise UnsupportedGenerationError(
                    f"DSparkGeneration.generate: {key}= given; the adapter brings its own cache "
                    "(DSparkCache). To keep one across calls, use attached() and new_cache()")
        beams = kwargs.get("num_beams")
        config = kwargs.get("generation_config")
        if beams is None and config is not None:
            beams = config.num_beams
        if beams is not None and beams > 1:
            raise UnsupportedGenerationError(
                f"DSparkGeneration.generate: num_beams={beams}; beam search forks the cache "
                "and the verifier's slots do not fork (use num_beams=1)")
        if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise UnsupportedGenerationError(
                f"DSparkGeneration.generate: a batch of {input_ids.shape[0]} sequences; the "
                "adapter decodes one at a time (HF's assisted generation is batch size 1 too)")
        cache = self.new_cache()
        try:
            with self.attached():
                return self.model.generate(input_ids, cache=cache, **kwargs)
        finally:
            self.last_cache_stats = {"steps": cache.steps, "verified_tokens":
                                     cache.verified_tokens, "committed": cache.committed}
            cache.close()


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
