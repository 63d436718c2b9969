"""Argument checks of the state's public calls: each refusal is a ``ValueError`` (or
``TypeError``) naming the argument, the value and the rule; nothing is coerced."""

from __future__ import annotations

import operator
import os

import numpy as np
import torch

__all__ = ["positive_size", "check_memory", "slot_ids", "accept_lens"]


def positive_size(owner: str, name: str, value) -> int:
    """``value`` as an int >= 1; bools (``True`` is not a size), floats and the rest refused."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"{owner}: {name}={value!r}; it must be an int >= 1")
    return int(value)


def _device_bytes(device: torch.device) -> int | None:
    """Memory of ``device`` in bytes (the host's physical memory for the CPU); None if unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None
    return None


def check_memory(owner: str, need: int, device, what: str) -> None:
    """Refuse an allocation of ``need`` bytes that the device cannot hold at all (an allocator
    error would name no argument, and a lazily committed host allocation could swap the machine)."""
    have = _device_bytes(torch.device(device))
    if have is not None and need > have:
        raise ValueError(
            f"{owner}: {what} needs {need / 2**30:.1f} GiB but {torch.device(device)} has "
            f"{have / 2**30:.1f} GiB in all; lower max_requests or max_context")


def slot_ids(owner: str, slots, max_requests: int) -> np.ndarray:
    """``slots`` (an int, or a 1-D sequence, NumPy array or tensor of ints) as int64 slot ids,
    each in ``0..max_requests-1``. Bools (a mask is not a list of slots), floats and negative
    ids (which would index from the end) are refused."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype == torch.bool or slots.dtype.is_floating_point or slots.is_complex():
            raise ValueError(f"{owner}: slots has dtype {slots.dtype}; it must hold int slot ids "
                             "(a mask is not a list of slots: pass mask.nonzero())")
        arr = slots.detach().cpu().numpy()
    elif isinstance(slots, (int, np.integer)) and not isinstance(slots, (bool, np.bool_)):
        arr = np.array([slots])
    elif isinstance(slots, (list, tuple, range, np.ndarray)):
        if isinstance(slots, np.ndarray):
            arr = slots
        else:
            if any(isinstance(s, (bool, np.bool_)) for s in slots):
                raise ValueError(f"{owner}: slots={list(slots)!r} holds a bool; it must hold "
                                 "int slot ids")
            try:
                arr = np.array([operator.index(s) for s in slots], dtype=np.int64)
            except TypeError as err:
                raise ValueError(f"{owner}: slots={list(slots)!r} holds a non-integer; it must "
                                 "hold int slot ids") from err
    else:
        raise ValueError(f"{owner}: slots is a {type(slots).__name__}; it must be an int or a "
                         "sequence of int slot ids")
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError(f"{owner}: slots has dtype {arr.dtype} and shape {arr.shape}; it must be "
                         "a 1-D sequence of int slot ids")
    arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= max_requests):
        bad = int(arr[(arr < 0) | (arr >= max_requests)][0])
        raise ValueError(f"{owner}: slots={arr.tolist()} has slot {bad}; slots must be in "
                         f"0..max_requests-1 = 0..{max_requests - 1}")
    return arr


def accept_lens(accept, num_requests: int) -> tuple[torch.Tensor, np.ndarray]:
    """``accept`` (a sequence, NumPy array or tensor of ints, one per request) as a CPU int64
    tensor and its NumPy view; an int64 NumPy array is taken as it is (no conversion)."""
    if isinstance(accept, np.ndarray) and accept.dtype == np.int64 and accept.ndim == 1:
        a = accept
        if a.size != num_requests:
            raise ValueError(f"commit: accept_lens has shape {a.shape}; it needs one entry per "
                             f"request ({num_requests})")
        return torch.from_numpy(a), a
    if isinstance(accept, torch.Tensor):
        if accept.device.type == "meta":
            raise ValueError("commit: accept_lens is a meta tensor (it holds no values); pass "
                             "the accepted lengths themselves")
        acc = accept.detach()
    elif isinstance(accept, (list, tuple, np.ndarray)):
        if isinstance(accept, (list, tuple)) and any(
                isinstance(a, (bool, np.bool_)) for a in accept):
            raise ValueError(f"commit: accept_lens={list(accept)!r} holds a bool; it must hold "
                             "ints")
        try:
            acc = torch.as_tensor(np.asarray(accept))
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"commit: accept_lens={accept!r} is not a sequence of ints") from err
    else:
        raise ValueError(f"commit: accept_lens is a {type(accept).__name__}; it must be a "
                         "sequence, NumPy array or tensor of ints, one per request")
    if acc.dim() != 1 or acc.numel() != num_requests:
        raise ValueError(f"commit: accept_lens has shape {tuple(acc.shape)}; it needs one entry "
                         f"per request ({num_requests})")
    if acc.dtype.is_floating_point or acc.dtype == torch.bool or acc.is_complex():
        raise ValueError(f"commit: accept_lens has dtype {acc.dtype}; it must be integers")
    acc = acc.cpu().to(torch.int64)
    return acc, acc.numpy()
