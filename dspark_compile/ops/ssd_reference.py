"""Pure-torch references of the Mamba-2 (SSD) ops: the ragged selective-state update and its
commit.

These are the CPU execution path and the oracle of the Triton kernels (``kernels/ssd.py``); the
argument rules here are shared with the kernels' host wrappers. Schemas and the ring layout are
documented in :mod:`dspark_compile.ops.ssd`.

Arithmetic, per token, HF's own order (``mamba2_chunk_scan`` of transformers' Mamba-2 family)::

    dt  <- dt + dt_bias          (in dt's dtype)      if dt_bias is given
    dt  <- softplus(dt)          (in dt's dtype)      if dt_softplus
    dt  <- clamp(dt, dt_min, dt_max), then float32
    xdt  = x.float() * dt                 [H, P]      what the update adds, per head
    da   = A.float() * dt                 [H]         log decay
    S   <- S * exp(da) + B_g (x) xdt      [H, N, P]   B of the head's group g = h // (H / G)
    out  = S^T C_g + D * x.float()        [H, P]      float32

HF computes the same recurrence in chunks (a quadratic form inside a chunk, a scan between
chunks); the token-serial form here agrees with it to float32 rounding, not bitwise.

Containment: a request's token ``j`` reads only its own tokens ``<= j`` and its slot's
committed state. Rows past a request's length in the padded ``[R, Tmax, ...]`` batch hold other
requests' rows (NaN included) and are dropped with ``torch.where`` selects, never by
multiplying with a zero mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear_attention_reference import (_FLOATS, _check_layout, _check_tensor, _fail,
                                         _gather_rows, _layout_values)

__all__ = ["check_ssd", "check_ssd_commit", "ssd", "ssd_commit", "ssd_step", "process_dt"]


def _check_rings(op: str, rings, h: int, g: int, n_state: int, p: int, min_rows: int, dev):
    names = ("ring_x", "ring_b", "ring_da")
    for name, t in zip(names, rings):
        _check_tensor(op, name, t, 2 if name == "ring_da" else 3, (torch.float32,), dev)
    m = rings[0].shape[0]
    for name, t, want in zip(names, rings, ((m, h, p), (m, g, n_state), (m, h))):
        if tuple(t.shape) != want or m < min_rows or not t.is_contiguous():
            _fail(op, f"{name} has shape {tuple(t.shape)}; the rings must be contiguous "
                      f"float32 [M, H, P], [M, G, N], [M, H] with M >= N_rows={min_rows} "
                      f"(here {want})")


def _check_vector(op: str, name: str, t, h: int, dev) -> None:
    _check_tensor(op, name, t, 1, _FLOATS, dev)
    if t.shape[0] != h:
        _fail(op, f"{name} has shape {tuple(t.shape)}; it must be ({h},), one per head")


def check_ssd(x, dt, A, B, C, D, dt_bias, state, qsl, slots, rings, dt_softplus, dt_min,
              dt_max) -> None:
    """Argument rules of ``dspark::ssd`` (shapes, dtypes, devices; no values)."""
    op = "ssd"
    dev = x.device if isinstance(x, torch.Tensor) else None
    for name, t, dims in (("x", x, 3), ("dt", dt, 2), ("B", B, 3), ("C", C, 3)):
        _check_tensor(op, name, t, dims, _FLOATS, dev)
    n, h, p = x.shape
    g, n_state = B.shape[1:]
    if dt.shape != (n, h):
        _fail(op, f"dt has shape {tuple(dt.shape)}; it must be [N, H] = {(n, h)} (x "
                  f"{tuple(x.shape)} is [N, H, P])")
    if C.shape != B.shape or B.shape[0] != n:
        _fail(op, f"B {tuple(B.shape)} and C {tuple(C.shape)} must both be [N, G, N_state] "
                  f"with N = {n} rows")
    if g == 0 or h % g:
        _fail(op, f"H={h} heads must be a multiple of G={g} groups (each group's B and C "
                  "serve H/G consecutive heads)")
    _check_vector(op, "A", A, h, dev)
    if D is not None:
        _check_vector(op, "D", D, h, dev)
    if dt_bias is not None:
        _check_vector(op, "dt_bias", dt_bias, h, dev)
    _check_tensor(op, "ssm_state", state, 4, (torch.float32,), dev)
    if state.shape[1:] != (h, n_state, p):
        _fail(op, f"ssm_state has shape {tuple(state.shape)}; it must be [S, H, N_state, P] "
                  f"= [S, {h}, {n_state}, {p}]")
    if not isinstance(dt_softplus, bool) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in (dt_min, dt_max)):
        _fail(op, f"dt_softplus={dt_softplus!r} must be a bool and dt_min={dt_min!r}, "
                  f"dt_max={dt_max!r} python floats")
    _check_rings(op, rings, h, g, n_state, p, n, dev)
    _check_layout(op, qsl, slots, dev)


def check_ssd_commit(state, rings, qsl, slots, accept_lens) -> None:
    """Argument rules of ``dspark::ssd_commit``."""
    op = "ssd_commit"
    dev = state.device if isinstance(state, torch.Tensor) else None
    _check_tensor(op, "ssm_state", state, 4, (torch.float32,), dev)
    _, h, n_state, p = state.shape
    if not isinstance(rings[1], torch.Tensor) or rings[1].dim() != 3 or rings[1].shape[1] == 0:
        _fail(op, "ring_b must be a float32 [M, G, N_state] tensor")
    _check_rings(op, rings, h, rings[1].shape[1], n_state, p, 0, dev)
    if h % rings[1].shape[1]:
        _fail(op, f"H={h} heads must be a multiple of the G={rings[1].shape[1]} groups of "
                  "ring_b")
    _check_layout(op, qsl, slots, dev, accept_lens)


def process_dt(dt, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float) -> torch.Tensor:
    """HF's time-step processing (bias, softplus, clamp in dt's dtype), as float32."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_min, max=dt_max).float()


def ssd_step(state, xdt, b, da):
    """One selective-state update. state ``[R, H, N, P]``, xdt ``[R, H, P]``, b ``[R, H, N]``,
    da ``[R, H]``; all float32, pure elementwise (a replay reproduces it bit for bit)."""
    return state * da.exp()[..., None, None] + b.unsqueeze(-1) * xdt.unsqueeze(-2)


def _replay(state, rings, starts, lens, group: int, c=None):
    """Run the recurrence over ``lens[i]`` rows of each request from the ring-form inputs.

    ``rings`` = (xdt [M, H, P], B [M, G, N], da [M, H]) in float32, ``state`` ``[R, H, N, P]``.
    With ``c`` (float32 [M, G, N]) also returns each step's ``S^T C`` ``[R, Tmax, H, P]``. A
    request that has run out of rows keeps its state through a select.
    Returns ``(state, outputs or None, valid [R, Tmax], rows [R, Tmax])``.
    """
    tmax = max(lens)
    (xdt, b, da), (valid, *_), (rows, *_) = zip(
        *[_gather_rows(t, starts, lens, tmax) for t in rings])
    cg = None if c is None else _gather_rows(c, starts, lens, tmax)[0]
    outs = []
    for t in range(tmax):
        bt = b[:, t].repeat_interleave(group, dim=1)  # [R, H, N]
        new = ssd_step(state, xdt[:, t], bt, da[:, t])
        state = torch.where(valid[:, t, None, None, None], new, state)
        if cg is not None:
            ct = cg[:, t].repeat_interleave(group, dim=1)  # [R, H, N]
            outs.append((state * ct.unsqueeze(-1)).sum(dim=-2))  # [R, H, P]
    return state, (torch.stack(outs, 1) if outs else None), valid, rows


def ssd(x, dt, A, B, C, D, dt_bias, state, qsl, slots, ring_x, ring_b, ring_da, dt_softplus,
        dt_min, dt_max):
    """Ragged Mamba-2 selective-state update from ``state[slot_i]``; saves the replay inputs.

    Returns ``[N, H, P]`` float32; padding rows are zeros. The pool is only read.
    """
    rings = (ring_x, ring_b, ring_da)
    check_ssd(x, dt, A, B, C, D, dt_bias, state, qsl, slots, rings, dt_softplus, dt_min,
              dt_max)
    n, h, p = x.shape
    out = x.new_zeros(n, h, p, dtype=torch.float32)
    starts, lens, _ = _layout_values("ssd", qsl, slots, n, state.shape[0], False)
    xf = x.float()
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max)  # [N, H]
    inputs = (xf * dtp[..., None], B.float(), A.float() * dtp)
    num_real = sum(lens)
    for ring, src in zip(rings, inputs):
        ring[:num_real].copy_(src[:num_real])
    if num_real == 0:
        return out
    s0 = state[slots.long().clamp(0, state.shape[0] - 1)]  # [R, H, N, P] (a copy)
    _, outs, valid, rows = _replay(s0, inputs, starts, lens, h // B.shape[1], C.float())
    y = outs[valid]  # [real rows, H, P]
    if D is not None:
        y = y + D[:, None] * xf[rows[valid]]
    out[rows[valid]] = y
    return out


def ssd_commit(state, ring_x, ring_b, ring_da, qsl, slots, accept_lens) -> None:
    """``state[slot_i]`` <- the state after replaying ring rows ``0..a_i-1`` of request ``i``.

    ``a_i = clamp(accept_lens[i], 0, len_i)``; requests with ``a_i = 0`` keep their state.
    """
    rings = (ring_x, ring_b, ring_da)
    check_ssd_commit(state, rings, qsl, slots, accept_lens)
    starts, lens, _ = _layout_values("ssd_commit", qsl, slots, ring_x.shape[0],
                                     state.shape[0], True)
    acc = [min(max(a, 0), n) for a, n in zip(accept_lens.tolist(), lens)]
    if not any(acc):
        return
    slot = slots.long().clamp(0, state.shape[0] - 1)
    new, *_ = _replay(state[slot], rings, starts, acc, state.shape[1] // ring_b.shape[1])
    active = torch.tensor(acc, device=state.device) > 0
    state.index_copy_(0, slot[active], new[active])
