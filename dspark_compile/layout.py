"""Packed-ragged verify layout: which rows of the flat token batch belong to which request.

Request ``i`` owns rows ``query_start_loc[i] : query_start_loc[i + 1]`` of every ``[N, ...]``
tensor of a verify step. Its tokens sit at positions ``context_lens[i] + j`` (``j`` counts its
own rows), and its cache lives in state-pool row ``slots[i]``. Models with multimodal rotary
positions (mRoPE) take ``[3, N]`` positions: ``context_lens[i] + j + mrope_deltas[i]`` in all
three rows, or, for a prefill of an image prompt, explicit ``mrope_positions``.

The layout is host metadata: it is validated on the host, before anything launches, and a bad
layout raises ``ValueError`` naming the field, the value and the rule.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["VerifyLayout"]

_INT32 = np.iinfo(np.int32)


_BOOLS = frozenset({bool, np.bool_})


class _Own:
    """An int32 array ``pack`` made itself: the layout takes it without a copy."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _as_host_int32(name: str, value, array_only: bool = False
                   ) -> tuple[torch.Tensor | None, np.ndarray]:
    """A list, an integer NumPy array or a CPU int32 tensor, as a 1-D CPU int32 tensor and a NumPy
    view of it (``array_only``: the tensor may be None, where none was given); anything else is
    refused, bools included (``True`` is not a length or a slot).

    The result is always a copy the layout owns: an engine that reuses its buffer after ``pack``
    cannot change a layout already built (a copy of 256 int32 costs ~0.4 us from NumPy and ~2.5 us
    from a tensor; re-validating at every call would cost the ~8 us of the checks, twice).
    Validation runs on every step of an engine, so the checks here and below use NumPy views (a
    small torch op on the CPU costs several microseconds, ``Tensor.numpy()`` alone ~2 us and
    ``torch.from_numpy`` ~1.6 us on a 2-core Xeon): each layout makes its views once."""
    if type(value) is _Own:
        return torch.from_numpy(value.array), value.array
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (list, tuple)) and not _BOOLS.isdisjoint(map(type, value)):
            raise ValueError(f"VerifyLayout.{name}={list(value)!r} holds a bool; it must hold "
                             "ints (True is not a length, context or slot)")
        arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
        if arr is not None and arr.dtype == np.bool_:
            raise ValueError(f"VerifyLayout.{name} is a bool array; it must hold ints (a mask "
                             "is not a list of slots: pass np.flatnonzero(mask))")
        if arr is not None and arr.ndim == 1 and arr.dtype.kind in "iu":
            if arr.dtype != np.int32 and arr.size and (
                    arr.min() < _INT32.min or arr.max() > _INT32.max):
                raise ValueError(f"VerifyLayout.{name}={value!r} does not fit in int32")
            if array_only:  # read once, not kept: no copy
                return None, np.ascontiguousarray(arr, dtype=np.int32)
            host = np.array(arr, dtype=np.int32)  # always a copy (see the docstring)
            return torch.from_numpy(host), host
    if isinstance(value, torch.Tensor):
        if not value.is_cpu:
            raise ValueError(
                f"VerifyLayout.{name} is on {value.device}; layout metadata must be a CPU tensor "
                "(it is validated on the host before any launch)"
            )
        if value.dtype != torch.int32:
            raise ValueError(
                f"VerifyLayout.{name} has dtype {value.dtype}; it must be torch.int32"
            )
        if value.dim() != 1:
            raise ValueError(
                f"VerifyLayout.{name} has shape {tuple(value.shape)}; it must be 1-D")
        host = np.array(value.detach().numpy(), dtype=np.int32)  # a copy (see the docstring)
        return torch.from_numpy(host), host
    try:
        items = [_index(x) for x in value]  # refuses 2.5 (and True) rather than coercing
        tensor = torch.tensor(items, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(f"VerifyLayout.{name}={value!r} is not a sequence of ints") from err
    if tensor.numel() and (tensor.min() < -(2**31) or tensor.max() >= 2**31):
        raise ValueError(f"VerifyLayout.{name}={value!r} does not fit in int32")
    tensor = tensor.to(torch.int32)
    if tensor.dim() != 1:
        raise ValueError(f"VerifyLayout.{name} has shape {tuple(tensor.shape)}; it must be 1-D")
    tensor = tensor.contiguous()
    return tensor, tensor.numpy()


def _index(x) -> int:
    if type(x) in _BOOLS:
        raise TypeError("a bool")
    return operator.index(x)


@dataclass(frozen=True)
class VerifyLayout:
    """Metadata of one packed-ragged forward (a prefill or a verify step)."""

    query_start_loc: torch.Tensor
    """int32 [R + 1], CPU. Row offsets of each request; starts at 0, non-decreasing."""
    context_lens: torch.Tensor
    """int32 [R], CPU. Tokens of each request already committed to the cache."""
    slots: torch.Tensor
    """int32 [R], CPU. State-pool row of each request; distinct."""
    mrope_deltas: torch.Tensor | None = None
    """int32 [R], CPU, or None (all 0). mRoPE models: how far each request's positions run
    from its length after its images (HF's ``rope_deltas``, ``max position + 1 - length`` of
    the prompt); ignored by text-rotary models."""
    mrope_positions: torch.Tensor | None = None
    """int64 [3, N], CPU, or None. mRoPE models: explicit positions of every row (a prefill of
    an image prompt, from HF's ``get_rope_index``); None: ``context + j + delta``."""

    def __post_init__(self) -> None:
        host = []
        for name in ("query_start_loc", "context_lens", "slots"):
            tensor, view = _as_host_int32(name, getattr(self, name))
            object.__setattr__(self, name, tensor)
            host.append(view)
        for view in host:  # the layout's own copies: nothing writes them after this
            view.flags.writeable = False
        # NumPy views of the three fields (not dataclass fields): see ``host``.
        object.__setattr__(self, "_host", tuple(host))
        if self.mrope_deltas is not None:
            object.__setattr__(self, "mrope_deltas",
                               _as_host_int32("mrope_deltas", self.mrope_deltas)[0])
        if isinstance(self.mrope_positions, torch.Tensor):
            object.__setattr__(self, "mrope_positions", self.mrope_positions.clone())
        self._check_self()
        self._check_mrope()
        object.__setattr__(self, "_versions", self._tensor_versions())

    def _tensor_versions(self) -> tuple[int, ...]:
        return (self.query_start_loc._version, self.context_lens._version, self.slots._version,
                -1 if self.mrope_deltas is None else self.mrope_deltas._version)

    def check_intact(self) -> None:
        """Refuse a layout whose tensors were written in place after it was built (its checks
        no longer hold); ~0.3 us, run by every verify and commit."""
        if self._tensor_versions() != self._versions:
            raise ValueError(
                "VerifyLayout: a field (query_start_loc, context_lens, slots or mrope_deltas) "
                "was written in place after the layout was built and validated; a layout is "
                "immutable: pack a new one for every step")

    # ------------------------------------------------------------------ construction
    @classmethod
    def pack(
        cls, lens: Sequence[int], context_lens: Sequence[int], slots: Sequence[int],
        mrope_deltas: Sequence[int] | None = None, mrope_positions: torch.Tensor | None = None,
    ) -> "VerifyLayout":
        """Build a layout from per-request verify lengths, committed context lengths and slots
        (and, for mRoPE models, per-request deltas or a prefill's explicit positions)."""
        lens_a = _as_host_int32("lens", lens, array_only=True)[1]
        if lens_a.size and lens_a.min() < 1:
            bad = int(lens_a[lens_a < 1][0])
            raise ValueError(
                f"VerifyLayout.lens contains {bad}; every verify length must be >= 1 "
                "(the anchor token is always verified)"
            )
        qsl = np.empty(lens_a.size + 1, dtype=np.int64)
        qsl[0] = 0
        np.add.accumulate(lens_a, dtype=np.int64, out=qsl[1:])  # cumsum, less its wrapper
        if qsl[-1] > _INT32.max:
            raise ValueError(f"VerifyLayout: {int(qsl[-1])} tokens in total do not fit in int32")
        return cls(query_start_loc=_Own(qsl.astype(np.int32)),  # the layout's own: no copy
                   context_lens=context_lens, slots=slots, mrope_deltas=mrope_deltas,
                   mrope_positions=mrope_positions)

    # ------------------------------------------------------------------ derived values
    @property
    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Read-only NumPy views of ``(query_start_loc, context_lens, slots)``, made once per
        layout, for host code that reads the layout every step; they share memory with the
        tensors, which are the layout's own copies of what it was built from."""
        return self._host

    @property
    def num_requests(self) -> int:
        """R: requests in the batch."""
        return self._host[2].size

    @property
    def num_tokens(self) -> int:
        """N: rows of the packed batch."""
        return int(self._host[0][-1])

    @property
    def lens(self) -> torch.Tensor:
        """int32 [R]: rows (verify length) per request."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def seq_lens(self) -> torch.Tensor:
        """int32 [R]: context plus verify length per request (keys each request's last row sees)."""
        return self.context_lens + self.lens

    @property
    def request_of_token(self) -> torch.Tensor:
        """int64 [N]: the request each packed row belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_requests), self.lens.to(torch.int64))

    @property
    def positions(self) -> torch.Tensor:
        """int64 [N]: position of each packed row, ``context_lens[i] + j``."""
        req = self.request_of_token
        local = torch.arange(self.num_tokens) - self.query_start_loc.to(torch.int64)[req]
        return self.context_lens.to(torch.int64)[req] + local

    @property
    def mrope_rows(self) -> torch.Tensor:
        """int64 [3, N]: mRoPE positions of each packed row (explicit, or context + j + delta)."""
        if self.mrope_positions is not None:
            return self.mrope_positions
        deltas = torch.zeros(self.num_requests, dtype=torch.int64) if self.mrope_deltas is None \
            else self.mrope_deltas.to(torch.int64)
        return (self.positions + deltas[self.request_of_token]).expand(3, -1)

    # ------------------------------------------------------------------ validation
    def _check_mrope(self) -> None:
        if self.mrope_deltas is not None and self.mrope_deltas.numel() != self.num_requests:
            raise ValueError(
                f"VerifyLayout.mrope_deltas has {self.mrope_deltas.numel()} entries for "
                f"{self.num_requests} requests; it needs one entry per request")
        pos = self.mrope_positions
        if pos is None:
            return
        if not isinstance(pos, torch.Tensor) or pos.device.type != "cpu" or \
                pos.dtype != torch.int64 or tuple(pos.shape) != (3, self.num_tokens):
            what = (f"a {pos.dtype} tensor of shape {tuple(pos.shape)} on {pos.device}"
                    if isinstance(pos, torch.Tensor) else f"a {type(pos).__name__}")
            raise ValueError(
                f"VerifyLayout.mrope_positions is {what}; it must be a CPU int64 tensor "
                f"[3, {self.num_tokens}] (three position rows per packed token)")
        if (pos < 0).any():
            raise ValueError("VerifyLayout.mrope_positions has a negative position; mRoPE "
                             "positions start at 0 (HF's get_rope_index)")

    def _check_self(self) -> None:
        qsl, ctx, slots = self._host
        if qsl.size < 2:
            raise ValueError(
                f"VerifyLayout.query_start_loc={qsl.tolist()} has {qsl.size} entries; it needs "
                "R + 1 >= 2 (at least one request)"
            )
        if int(qsl[0]) != 0:
            raise ValueError(
                f"VerifyLayout.query_start_loc[0]={int(qsl[0])}; it must start at 0"
            )
        lens = qsl[1:] - qsl[:-1]  # np.diff costs 3x more per call at these sizes
        if lens.min() < 1:
            i = int(np.flatnonzero(lens < 1)[0])
            raise ValueError(
                f"VerifyLayout.query_start_loc={qsl.tolist()} gives request {i} length "
                f"{int(lens[i])}; query_start_loc must increase by at least 1 per request "
                "(every verify length >= 1)"
            )
        r = qsl.size - 1
        for name, t in (("context_lens", ctx), ("slots", slots)):
            if t.size != r:
                raise ValueError(
                    f"VerifyLayout.{name} has {t.size} entries but query_start_loc describes "
                    f"{r} requests; it needs one entry per request"
                )
        if ctx.min() < 0:
            raise ValueError(f"VerifyLayout.context_lens={ctx.tolist()} has a negative entry")
        ordered = np.sort(slots)  # its first entry is the least: no separate min()
        if ordered[0] < 0:
            raise ValueError(f"VerifyLayout.slots={slots.tolist()} has a negative entry")
        if r > 1 and _repeats(ordered):
            raise ValueError(
                f"VerifyLayout.slots={slots.tolist()} repeats a slot; each request needs its own "
                "state-pool row"
            )

    def validate(self, num_tokens: int, max_requests: int, max_context: int) -> None:
        """Check the layout against a batch of ``num_tokens`` rows and a state pool.

        Raises ``ValueError`` naming the field, the value and the rule.
        """
        if num_tokens != self.num_tokens:
            raise ValueError(
                f"input_ids has {num_tokens} rows but VerifyLayout.query_start_loc[-1]="
                f"{self.num_tokens}; they must be equal"
            )
        qsl, ctx, slots = self._host
        if int(slots.max()) >= max_requests:
            raise ValueError(
                f"VerifyLayout.slots={slots.tolist()} has slot {int(slots.max())}; slots "
                f"must be < max_requests={max_requests} of the state"
            )
        seq = np.add(ctx, qsl[1:] - qsl[:-1], dtype=np.int64)  # [R]: no int32 overflow
        if seq.max() > max_context:
            i = int(np.flatnonzero(seq > max_context)[0])
            raise ValueError(
                f"request {i}: context_lens={int(ctx[i])} + length "
                f"{int(qsl[i + 1] - qsl[i])} = {int(seq[i])} exceeds the state's "
                f"max_context={max_context}"
            )


def _repeats(sorted_values: np.ndarray) -> bool:
    """Whether a sorted array holds a value twice."""
    return bool((sorted_values[1:] == sorted_values[:-1]).any())
