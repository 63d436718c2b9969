"""Pure-torch reference of the mixture-of-experts ops (``ops/experts.py``): the CPU path and
the oracle of the Triton kernels.

Static shapes throughout (no host sync, no allocation sized by the routing), so the reference
also runs inside a CUDA graph: each routed (token, expert) pair gathers its expert's weights and
runs one batched matrix-vector product, the arithmetic of transformers' ``batched_mm`` experts
(exact, but it moves a copy of the weights per pair: a test and CPU path, never the GPU's).

Pairs are ``p = n * K + k`` (token ``n``, its ``k``-th choice). A pair is *routed* when its
expert id lies in ``[0, E)`` and its token is a real row (``n < query_start_loc[R]``); every
other pair routes nowhere: its rows of the intermediate come out as zeros and it adds nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "activate", "check_route", "check_up", "check_down", "route",
           "pair_experts", "up", "down", "up_columns"]

ACTIVATIONS = ("none", "silu_glu", "gelu_glu", "gelu_tanh_glu")
"""What ``experts_up`` applies to each row of ``x @ W_up[e].T + b``: ``none`` keeps the ``F``
columns; a ``*_glu`` gate splits them into ``[gate | up]`` halves (transformers' default
``_apply_gate``: ``act(gate) * up``) and returns ``F // 2``."""

_GLU = {"silu_glu": F.silu, "gelu_glu": F.gelu,
        "gelu_tanh_glu": lambda t: F.gelu(t, approximate="tanh")}


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """``activation`` of ``y [rows, F]`` in ``y``'s dtype (the ops the model's gate runs)."""
    if activation == "none":
        return y
    gate, up_half = y.chunk(2, dim=-1)
    return _GLU[activation](gate) * up_half


def up_columns(w: torch.Tensor, transposed: bool, activation: str) -> int:
    """Columns of ``experts_up``'s result: ``F`` (``F // 2`` under a GLU gate)."""
    f = w.shape[2] if transposed else w.shape[1]
    return f if activation == "none" else f // 2


def _fail(op: str, what: str) -> None:
    raise ValueError(f"dspark::{op}: {what}")


def _differ(a, b) -> bool:
    """``a != b`` decided without a guard on a symbolic size (undecided: not different), so
    the fake checks never constrain a capture's ``bs`` or ``T``."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a != b)


def check_route(ids: torch.Tensor, query_start_loc, num_experts: int) -> None:
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        _fail("experts_route", f"ids must be int32/int64 [N, K] (each token's chosen experts), "
              f"got {ids.dtype} {tuple(ids.shape)}")
    if num_experts < 1:
        _fail("experts_route", f"num_experts={num_experts}; it must be at least 1")
    if query_start_loc is not None and query_start_loc.dim() != 1:
        _fail("experts_route", f"query_start_loc must be 1-D [R+1], got "
              f"{tuple(query_start_loc.shape)}")


def _check_routing(op: str, order: torch.Tensor, offsets: torch.Tensor, rows: int,
                   num_experts: int) -> None:
    if order.dim() != 1 or offsets.dim() != 1 or order.dtype != torch.int32 or \
            offsets.dtype != torch.int32:
        _fail(op, "order [N*K] and offsets [E] must be the int32 results of experts_route, got "
              f"{order.dtype} {tuple(order.shape)} and {offsets.dtype} {tuple(offsets.shape)}")
    if _differ(offsets.shape[0], num_experts):
        _fail(op, f"offsets has {offsets.shape[0]} entries but the weights hold {num_experts} "
              "experts; route with num_experts = weights.shape[0]")
    if isinstance(rows, int) and isinstance(order.shape[0], int) and rows and \
            order.shape[0] % rows:
        _fail(op, f"order has {order.shape[0]} pairs, not a multiple of the {rows} token rows")


def _check_weights(op: str, w: torch.Tensor, bias, transposed: bool, k_dim: int):
    """``(E, in, out)`` of an expert table; raises unless ``in == k_dim``."""
    if w.dim() != 3:
        _fail(op, f"weights must be [E, out, in] (or [E, in, out] when transposed), got "
              f"{tuple(w.shape)}")
    e, a, b = w.shape
    n_in, n_out = (a, b) if transposed else (b, a)
    if _differ(n_in, k_dim):
        _fail(op, f"weights {tuple(w.shape)} (transposed={transposed}) take {n_in} input "
              f"columns but the rows have {k_dim}")
    if bias is not None and (bias.dim() != 2 or _differ(bias.shape[0], e) or
                             _differ(bias.shape[1], n_out)):
        _fail(op, f"bias must be [E, out] = {(e, n_out)}, got {tuple(bias.shape)}")
    return e, n_in, n_out


def check_up(x, order, offsets, w, bias, transposed: bool, activation: str) -> None:
    if x.dim() != 2:
        _fail("experts_up", f"x must be [N, D] token rows, got {tuple(x.shape)}")
    if x.dtype != w.dtype:
        _fail("experts_up", f"x is {x.dtype} but the weights {w.dtype}; cast the rows to the "
              "weights' dtype first (transformers' grouped_mm does)")
    if activation not in ACTIVATIONS:
        _fail("experts_up", f"activation={activation!r}; known: {ACTIVATIONS}")
    e, _, n_out = _check_weights("experts_up", w, bias, transposed, x.shape[1])
    if activation != "none" and n_out % 2:
        _fail("experts_up", f"a GLU gate needs an even number of columns, got {n_out}")
    _check_routing("experts_up", order, offsets, x.shape[0], e)


def check_down(h, order, offsets, weights, w, bias, transposed: bool) -> None:
    if h.dim() != 2 or weights.dim() != 2:
        _fail("experts_down", f"h must be [N*K, I] and weights [N, K], got {tuple(h.shape)} "
              f"and {tuple(weights.shape)}")
    if _differ(h.shape[0], order.shape[0]) or _differ(weights.numel(), order.shape[0]):
        _fail("experts_down", f"h has {h.shape[0]} rows and weights {weights.numel()} entries "
              f"but there are {order.shape[0]} pairs; each must hold one per pair")
    if h.dtype != w.dtype:
        _fail("experts_down", f"h is {h.dtype} but the weights {w.dtype}")
    e, _, _ = _check_weights("experts_down", w, bias, transposed, h.shape[1])
    _check_routing("experts_down", order, offsets, weights.shape[0], e)


# ---------------------------------------------------------------------- reference
def route(ids: torch.Tensor, query_start_loc: torch.Tensor | None,
          num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [N*K] int32, offsets [E] int32)``: the pairs sorted by expert (stable: by pair
    within an expert; unrouted pairs last) and each expert's end in ``order``."""
    n, k = ids.shape
    key = ids.to(torch.int64)
    routed = (key >= 0) & (key < num_experts)
    if query_start_loc is not None:
        real = torch.arange(n, device=ids.device) < query_start_loc[-1].to(torch.int64)
        routed = routed & real[:, None]
    key = torch.where(routed, key, num_experts).reshape(-1)
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    return order, counts[:num_experts].cumsum(0).to(torch.int32)


def pair_experts(order: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[N*K]``: each pair's expert, ``E`` for a pair routed nowhere."""
    positions = torch.arange(order.shape[0], device=order.device)
    by_position = torch.searchsorted(offsets.to(torch.int64), positions, right=True)
    return torch.empty_like(by_position).scatter_(0, order.to(torch.int64), by_position)


def _expert_rows(rows: torch.Tensor, w: torch.Tensor, bias, transposed: bool,
                 experts: torch.Tensor) -> torch.Tensor:
    """``rows[p] @ W[experts[p]]`` (+ bias) per pair, as transformers' ``batched_mm`` does;
    the pairs in chunks whose gathered weights take at most :data:`GATHER_BYTES` (each pair's
    product is its own, so the chunking changes no bit: 768 rows of Qwen3-30B-A3B's experts
    gathered 72 GiB at once)."""
    per_pair = w[0].numel() * w.element_size()
    step = max(1, GATHER_BYTES // max(1, per_pair))
    out = []
    for lo in range(0, experts.shape[0], step) or [0]:  # no pairs: one empty product
        e, r = experts[lo:lo + step], rows[lo:lo + step]
        picked = w.index_select(0, e)
        if transposed:  # [S, 1, in] @ [S, in, out]
            out.append(torch.bmm(r.unsqueeze(1), picked).squeeze(1))
        else:  # [S, out, in] @ [S, in, 1]
            out.append(torch.bmm(picked, r.unsqueeze(-1)).squeeze(-1))
    y = out[0] if len(out) == 1 else torch.cat(out)
    return y if bias is None else y + bias.index_select(0, experts)


GATHER_BYTES = 1 << 30
"""Most bytes of expert weights :func:`_expert_rows` gathers at once."""


def up(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor,
       bias: torch.Tensor | None, transposed: bool, activation: str) -> torch.Tensor:
    """``[N*K, F']``: row ``p`` is ``activation(x[p // K] @ W[e_p].T + b[e_p])``; zeros for
    pairs routed nowhere."""
    n, e, s = x.shape[0], w.shape[0], order.shape[0]
    experts = pair_experts(order, offsets)
    routed = experts < e
    rows = x.repeat_interleave(s // n, dim=0) if n else x.new_empty(0, x.shape[1])
    y = activate(_expert_rows(rows, w, bias, transposed, experts.clamp(max=e - 1)), activation)
    return torch.where(routed[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def down(h: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
         w: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """``[N, D]``: ``sum_k weights[n, k] * (h[p] @ W[e_p].T + b[e_p])`` over the routed pairs
    ``p = n*K + k``, in transformers' order (product per pair, then the sum over ``k``)."""
    n, e = weights.shape[0], w.shape[0]
    experts = pair_experts(order, offsets)
    routed = experts < e
    y = _expert_rows(h, w, bias, transposed, experts.clamp(max=e - 1))
    y = y * weights.reshape(-1, 1)
    y = torch.where(routed[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.view(n, weights.shape[1], y.shape[-1]).sum(dim=1)
