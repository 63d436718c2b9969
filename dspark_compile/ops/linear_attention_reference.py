"""Pure-torch references of the hybrid-layer ops: ragged causal conv1d and gated delta rule.

These are the CPU execution path and the oracle of the Triton kernels (``triton_conv``,
``triton_gdn``); the argument rules here are shared with the kernels' host wrappers. Op
schemas and the replay-ring layout are documented in :mod:`dspark_compile.ops.linear_attention`.

Containment: a request's token ``j`` reads only its own tokens ``<= j`` and its slot's
committed state. The references gather every request into a padded ``[R, Tmax, ...]`` batch;
the slots past a request's length hold other requests' rows (NaN included) and are dropped
with ``torch.where`` selects, never by multiplying with a zero mask (``0 * NaN`` is NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "check_conv", "check_conv_commit", "check_gdn", "check_gdn_commit",
           "causal_conv1d", "causal_conv1d_commit", "gated_delta_rule",
           "gated_delta_rule_commit", "l2norm"]

ACTIVATIONS = ("silu", "none", "gelu", "gelu_pytorch_tanh")
"""Activations of ``dspark::causal_conv1d``, by the names HF hands ``causal_conv1d_fn``
(``config.hidden_act``; its GDN and Mamba-2 layers use ``silu``): ``ACT2FN``'s SiLU, erf GELU
and tanh-approximated GELU; anything else is refused by name."""
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def _fail(op: str, msg: str) -> None:
    raise ValueError(f"{op}: {msg}")


def _check_tensor(op: str, name: str, t, dims: int, dtypes, device,
                  dense_last: bool = True) -> None:
    """``t`` is a tensor of rank ``dims``, one of ``dtypes``, on ``device`` (dense last dim)."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} is {type(t).__name__}; it must be a tensor")
    if t.dim() != dims:
        _fail(op, f"{name} has shape {tuple(t.shape)}; it must be {dims}-D")
    if t.dtype not in dtypes:
        _fail(op, f"{name} has dtype {t.dtype}; it must be one of {dtypes}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device} but the first argument is on {device}; move "
                  "every argument there")
    if dense_last and t.numel() and t.stride(-1) != 1:
        _fail(op, f"{name} has strides {t.stride()}; the last dim must be dense (stride 1)")


def _check_layout(op: str, qsl, slots, device, accept_lens=None) -> int:
    """Shapes of ``query_start_loc [R+1]``, ``slots [R]`` (and ``accept_lens [R]``); returns R."""
    _check_tensor(op, "query_start_loc", qsl, 1, _INTS, device)
    _check_tensor(op, "slots", slots, 1, _INTS, device)
    r = qsl.shape[0] - 1
    if r < 0 or slots.shape[0] != r:
        _fail(op, f"query_start_loc {tuple(qsl.shape)} describes R={r} requests; slots "
                  f"{tuple(slots.shape)} needs R entries (R+1 start offsets, R >= 0)")
    if accept_lens is not None:
        _check_tensor(op, "accept_lens", accept_lens, 1, _INTS, device)
        if accept_lens.shape[0] != r:
            _fail(op, f"accept_lens has shape {tuple(accept_lens.shape)}; it needs R={r} "
                      "entries, one per request")
    return r


def check_conv(x, weight, bias, conv_state, qsl, slots, ring, activation) -> None:
    """Argument rules of ``dspark::causal_conv1d`` (shapes, dtypes, devices; no values)."""
    op = "causal_conv1d"
    _check_tensor(op, "x", x, 2, _FLOATS, x.device if isinstance(x, torch.Tensor) else None)
    n, dim = x.shape
    _check_tensor(op, "weight", weight, 2, _FLOATS, x.device)
    # any strides: [S, W-1, dim]-major pools (dim contiguous) pass as a transposed view
    _check_tensor(op, "conv_state", conv_state, 3, (x.dtype,), x.device, dense_last=False)
    _check_tensor(op, "ring", ring, 2, (x.dtype,), x.device)
    width = weight.shape[1]
    if weight.shape[0] != dim or width < 2:
        _fail(op, f"weight has shape {tuple(weight.shape)}; it must be [dim, width] = "
                  f"[{dim}, >= 2] (dim from x {tuple(x.shape)})")
    if bias is not None:
        _check_tensor(op, "bias", bias, 1, (weight.dtype,), x.device)
        if bias.shape[0] != dim:
            _fail(op, f"bias has shape {tuple(bias.shape)}; it must be ({dim},)")
    if conv_state.shape[1:] != (dim, width - 1):
        _fail(op, f"conv_state has shape {tuple(conv_state.shape)}; it must be [slots, dim, "
                  f"width-1] = [S, {dim}, {width - 1}]")
    if ring.shape[1] != dim or ring.shape[0] < n:
        _fail(op, f"ring has shape {tuple(ring.shape)}; it must be [M, {dim}] with M >= N={n} "
                  "(one saved input row per packed token)")
    if activation not in ACTIVATIONS:
        _fail(op, f"activation={activation!r}; it must be one of {ACTIVATIONS}")
    _check_layout(op, qsl, slots, x.device)


def check_conv_commit(conv_state, ring, qsl, slots, accept_lens) -> None:
    """Argument rules of ``dspark::causal_conv1d_commit``."""
    op = "causal_conv1d_commit"
    dev = conv_state.device if isinstance(conv_state, torch.Tensor) else None
    _check_tensor(op, "conv_state", conv_state, 3, _FLOATS, dev, dense_last=False)
    _check_tensor(op, "ring", ring, 2, (conv_state.dtype,), dev)
    if ring.shape[1] != conv_state.shape[1]:
        _fail(op, f"ring {tuple(ring.shape)} and conv_state {tuple(conv_state.shape)} must "
                  "have the same dim")
    _check_layout(op, qsl, slots, dev, accept_lens)


def _gdn_ring_shapes(m: int, hk: int, hv: int, kd: int, vd: int,
                     channel_gates: bool) -> tuple:
    return (m, hk, kd), (m, hv, vd), (m, hv, kd) if channel_gates else (m, hv), (m, hv)


def _check_rings(op: str, rings, hk: int, hv: int, kd: int, vd: int, min_rows: int, dev,
                 channel_gates: bool):
    names = ("ring_k", "ring_v", "ring_g", "ring_beta")
    for name, t in zip(names, rings):
        dims = 3 if name in ("ring_k", "ring_v") or (name == "ring_g" and channel_gates) else 2
        _check_tensor(op, name, t, dims, (torch.float32,), dev)
    m = rings[0].shape[0]
    for name, t, want in zip(names, rings, _gdn_ring_shapes(m, hk, hv, kd, vd, channel_gates)):
        if tuple(t.shape) != want or m < min_rows or not t.is_contiguous():
            _fail(op, f"{name} has shape {tuple(t.shape)}; the rings must be contiguous "
                      f"float32 [M, Hk, K], [M, Hv, V], [M, Hv{', K' if channel_gates else ''}]"
                      f", [M, Hv] with M >= N={min_rows} (here {want})")


def check_gdn(q, k, v, g, beta, state, qsl, slots, rings, scale, use_qk_l2norm) -> None:
    """Argument rules of ``dspark::gated_delta_rule``."""
    op = "gated_delta_rule"
    dev = q.device if isinstance(q, torch.Tensor) else None
    channel_gates = isinstance(g, torch.Tensor) and g.dim() == 3
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 3 if channel_gates
                                                                      else 2),
                          ("beta", beta, 2)):
        _check_tensor(op, name, t, dims, _FLOATS, dev)
    _check_tensor(op, "recurrent_state", state, 4, (torch.float32,), dev)
    n, hk, kd = k.shape
    hv, vd = v.shape[1:]
    if q.dtype != k.dtype:
        _fail(op, f"q has dtype {q.dtype} and k {k.dtype}; they must share one (their rows are "
                  "taken together)")
    if q.shape != k.shape or v.shape[0] != n:
        _fail(op, f"q {tuple(q.shape)}, k {tuple(k.shape)} must both be [N, Hk, K] and v "
                  f"{tuple(v.shape)} [N, Hv, V]")
    if hk == 0 or hv % hk:
        _fail(op, f"Hv={hv} value heads must be a multiple of Hk={hk} key heads (each key "
                  "head serves Hv/Hk consecutive value heads)")
    if g.shape != ((n, hv, kd) if channel_gates else (n, hv)) or beta.shape != (n, hv):
        _fail(op, f"g {tuple(g.shape)} must be [N, Hv] = {(n, hv)} (one gate a head) or "
                  f"[N, Hv, K] = {(n, hv, kd)} (one a key channel), and beta "
                  f"{tuple(beta.shape)} [N, Hv] = {(n, hv)}")
    if state.shape[1:] != (hv, kd, vd):
        _fail(op, f"recurrent_state has shape {tuple(state.shape)}; it must be [S, Hv, K, V] "
                  f"= [S, {hv}, {kd}, {vd}]")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not isinstance(use_qk_l2norm, bool):
        _fail(op, f"scale={scale!r} must be a python float and use_qk_l2norm="
                  f"{use_qk_l2norm!r} a bool")
    if not isinstance(rings[2], torch.Tensor) or rings[2].dim() != g.dim():
        _fail(op, f"ring_g must be a float32 tensor shaped like g's rows: [M, "
                  f"{'Hv, K' if channel_gates else 'Hv'}] for g {tuple(g.shape)}")
    _check_rings(op, rings, hk, hv, kd, vd, n, dev, channel_gates)
    _check_layout(op, qsl, slots, dev)


def check_gdn_commit(state, rings, qsl, slots, accept_lens) -> None:
    """Argument rules of ``dspark::gated_delta_rule_commit``."""
    op = "gated_delta_rule_commit"
    dev = state.device if isinstance(state, torch.Tensor) else None
    _check_tensor(op, "recurrent_state", state, 4, (torch.float32,), dev)
    _, hv, kd, vd = state.shape
    if not isinstance(rings[0], torch.Tensor) or rings[0].dim() != 3 or rings[0].shape[1] == 0:
        _fail(op, "ring_k must be a float32 [M, Hk, K] tensor")
    channel_gates = isinstance(rings[2], torch.Tensor) and rings[2].dim() == 3
    _check_rings(op, rings, rings[0].shape[1], hv, kd, vd, 0, dev, channel_gates)
    _check_layout(op, qsl, slots, dev, accept_lens)


def _layout_values(op: str, qsl, slots, num_rows: int, num_slots: int, distinct: bool):
    """Host copies of the layout, checked (the reference syncs anyway): (starts, lens, slots)."""
    starts = qsl.tolist()
    if starts and (starts[0] != 0 or starts[-1] > num_rows or
                   any(b < a for a, b in zip(starts, starts[1:]))):
        _fail(op, f"query_start_loc={starts} must start at 0, be non-decreasing and end at "
                  f"most at N={num_rows}")
    lens = [b - a for a, b in zip(starts, starts[1:])]
    used = [s for s, n in zip(slots.tolist(), lens) if n > 0]
    if any(not 0 <= s < num_slots for s in used) or (distinct and len(set(used)) < len(used)):
        _fail(op, f"slots {slots.tolist()} of non-empty requests must lie in [0, {num_slots})"
                  + (" and be distinct" if distinct else ""))
    return starts[:-1], lens, used


def _gather_rows(t: torch.Tensor, starts, lens, tmax: int):
    """``t[starts[i] + j]`` as ``[R, tmax, ...]`` and the ``[R, tmax]`` mask ``j < lens[i]``.

    Slots past a request's length are clamped reads of some other row; callers drop them with
    selects.
    """
    j = torch.arange(tmax, device=t.device)
    starts_t = torch.tensor(starts, device=t.device, dtype=torch.long)
    valid = j[None, :] < torch.tensor(lens, device=t.device)[:, None]
    rows = (starts_t[:, None] + j[None, :]).clamp(max=max(t.shape[0] - 1, 0))
    return t[rows], valid, rows


def causal_conv1d(x, weight, bias, conv_state, qsl, slots, ring, activation):
    """Ragged causal depthwise conv1d over ``[conv_state[slot], own rows]``; saves x in ``ring``.

    One ``F.conv1d`` call over the zero-padded batch ``cat(state, x_i)`` of every request, the
    call HF's ``causal_conv1d_fn`` makes: real rows are bit-identical to it (float32, CPU).
    """
    check_conv(x, weight, bias, conv_state, qsl, slots, ring, activation)
    n, dim = x.shape
    out = x.new_zeros(n, dim)
    starts, lens, _ = _layout_values("causal_conv1d", qsl, slots, n, conv_state.shape[0], False)
    width = weight.shape[1]
    num_real = sum(lens)
    ring[:num_real].copy_(x[:num_real])
    if num_real == 0:
        return out
    tmax = max(lens)
    xs, valid, rows = _gather_rows(x, starts, lens, tmax)  # [R, Tmax, dim]
    xs = torch.where(valid[..., None], xs, torch.zeros((), dtype=x.dtype))
    state = conv_state[slots.long().clamp(0, conv_state.shape[0] - 1)]  # [R, dim, W-1]
    seq = torch.cat([state, xs.transpose(1, 2)], dim=-1).to(weight.dtype)  # [R, dim, W-1+Tmax]
    y = F.conv1d(seq, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
    y = y[..., :seq.shape[-1]]
    if activation == "silu":
        y = F.silu(y)
    elif activation != "none":
        y = F.gelu(y, approximate="tanh" if activation == "gelu_pytorch_tanh" else "none")
    y = y[..., width - 1:].transpose(1, 2).to(x.dtype)  # [R, Tmax, dim]
    out[rows[valid]] = y[valid]
    return out


def causal_conv1d_commit(conv_state, ring, qsl, slots, accept_lens) -> None:
    """``conv_state[slot_i]`` <- last ``W-1`` of ``[conv_state[slot_i], ring rows 0..a_i-1]``.

    ``a_i = clamp(accept_lens[i], 0, len_i)``; requests with ``a_i = 0`` keep their state.
    """
    check_conv_commit(conv_state, ring, qsl, slots, accept_lens)
    starts, lens, _ = _layout_values("causal_conv1d_commit", qsl, slots, ring.shape[0],
                                     conv_state.shape[0], True)
    accepted = [min(max(a, 0), n) for a, n in zip(accept_lens.tolist(), lens)]
    if not any(accepted):
        return
    dev, keep = ring.device, conv_state.shape[2]
    acc = torch.tensor(accepted, device=dev)
    slot = slots.long().clamp(0, conv_state.shape[0] - 1)
    pos = acc[:, None] + torch.arange(keep, device=dev)  # [R, W-1] in cat(state, rows) coords
    from_state = pos < keep
    old = conv_state[slot].gather(2, pos.clamp(max=keep - 1)[:, None, :].expand(
        -1, conv_state.shape[1], -1))  # [R, dim, W-1]
    rows = (torch.tensor(starts, device=dev)[:, None] + pos - keep).clamp(0, ring.shape[0] - 1)
    new = torch.where(from_state[:, None, :], old, ring[rows].transpose(1, 2))
    active = acc > 0
    conv_state.index_copy_(0, slot[active], new[active])


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, written as HF's (and FLA's) ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _delta_step(state, k, v, g, beta):
    """One gated delta-rule update, HF's op order. state ``[R, Hv, K, V]``, k ``[R, Hv, K]``,
    g ``[R, Hv]`` (one gate a head) or ``[R, Hv, K]`` (one a key channel: Kimi's KDA)."""
    state = state * (g.exp()[..., None] if g.dim() == 3 else g.exp()[..., None, None])
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)  # [R, Hv, V]
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def _replay(state, rings, starts, lens, group: int, q=None):
    """Run the recurrence over ``lens[i]`` rows of each request from the ring-form inputs.

    ``rings`` = (k [M, Hk, K], v [M, Hv, V], g [M, Hv] or [M, Hv, K], beta [M, Hv]) in float32,
    ``state`` ``[R, Hv, K, V]``. With ``q`` (float32, scaled, [M, Hk, K]) also returns each step's output ``[R,
    Tmax, Hv, V]``. A request that has run out of rows keeps its state through a select.
    Returns ``(state, outputs or None, valid [R, Tmax], rows [R, Tmax])``.
    """
    tmax = max(lens)
    (k, v, g, beta), (valid, *_), (rows, *_) = zip(
        *[_gather_rows(t, starts, lens, tmax) for t in rings])
    qg = None if q is None else _gather_rows(q, starts, lens, tmax)[0]
    outs = []
    for t in range(tmax):
        kt = k[:, t].repeat_interleave(group, dim=1)  # [R, Hv, K]
        new = _delta_step(state, kt, v[:, t], g[:, t], beta[:, t])
        state = torch.where(valid[:, t, None, None, None], new, state)
        if qg is not None:
            qt = qg[:, t].repeat_interleave(group, dim=1)  # [R, Hv, K]
            outs.append((state * qt.unsqueeze(-1)).sum(dim=-2))  # [R, Hv, V]
    return state, (torch.stack(outs, 1) if outs else None), valid, rows


def gated_delta_rule(q, k, v, g, beta, state, qsl, slots, ring_k, ring_v, ring_g, ring_beta,
                     scale, use_qk_l2norm):
    """Ragged gated delta rule from ``state[slot_i]``; saves the replay inputs in the rings.

    Returns ``[N, Hv, V]`` in q's dtype; padding rows are zeros. The pool is only read.
    """
    rings = (ring_k, ring_v, ring_g, ring_beta)
    check_gdn(q, k, v, g, beta, state, qsl, slots, rings, scale, use_qk_l2norm)
    n, hk, _ = k.shape
    hv, vd = v.shape[1:]
    out = q.new_zeros(n, hv, vd)
    starts, lens, _ = _layout_values("gated_delta_rule", qsl, slots, n, state.shape[0], False)
    qf, kf = q.float(), k.float()
    if use_qk_l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    num_real = sum(lens)
    inputs = (kf, v.float(), g.float(), beta.float())
    for ring, src in zip(rings, inputs):
        ring[:num_real].copy_(src[:num_real])
    if num_real == 0:
        return out
    s0 = state[slots.long().clamp(0, state.shape[0] - 1)]  # [R, Hv, K, V] (a copy)
    _, outs, valid, rows = _replay(s0, inputs, starts, lens, hv // hk, qf * scale)
    out[rows[valid]] = outs[valid].to(q.dtype)
    return out


def gated_delta_rule_commit(state, ring_k, ring_v, ring_g, ring_beta, qsl, slots,
                            accept_lens) -> None:
    """``state[slot_i]`` <- the state after replaying ring rows ``0..a_i-1`` of request ``i``.

    ``a_i = clamp(accept_lens[i], 0, len_i)``; requests with ``a_i = 0`` keep their state.
    """
    rings = (ring_k, ring_v, ring_g, ring_beta)
    check_gdn_commit(state, rings, qsl, slots, accept_lens)
    starts, lens, _ = _layout_values("gated_delta_rule_commit", qsl, slots, ring_k.shape[0],
                                     state.shape[0], True)
    acc = [min(max(a, 0), n) for a, n in zip(accept_lens.tolist(), lens)]
    if not any(acc):
        return
    slot = slots.long().clamp(0, state.shape[0] - 1)
    new, *_ = _replay(state[slot], rings, starts, acc, state.shape[1] // ring_k.shape[1])
    active = torch.tensor(acc, device=state.device) > 0
    state.index_copy_(0, slot[active], new[active])
