"""The hybrid-layer ``dspark::`` ops: ragged causal conv1d and gated delta rule, with rollback.

HF's Qwen3-Next / Qwen3.5 Gated DeltaNet layers (and Mamba2's conv) mix tokens through
``causal_conv1d_fn`` and ``torch_*_gated_delta_rule``; these ops are their packed-ragged forms.
Layout (DESIGN.md, Core contracts): request ``i`` owns rows ``query_start_loc[i] :
query_start_loc[i+1]`` of every ``[N, ...]`` tensor; rows past ``query_start_loc[R]`` are
padding (no request; outputs zeros, nothing written). ``slots[i]`` is its state-pool row.

Rollback through a replay ring. The forward ops only *read* the state pools; they save the
per-token inputs the recurrence needs into ring buffers indexed by packed row (padding rows
write nothing). After acceptance, a commit op replays each request's first ``accept_lens[i]``
ring rows onto its pool row, in place. A rejected draft's row is never replayed, so whatever
it holds (NaN included) never reaches the committed state. ``accept_lens`` is a device tensor
(no host sync); values are clamped to ``[0, len_i]`` and 0 leaves the slot unchanged.

Schemas (the reference ops; each has a ``*_triton`` twin in ``kernels/ops.py``, CUDA/ROCm
only, same schema)::

    dspark::causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor conv_state,
        Tensor query_start_loc, Tensor slots, Tensor(a!) ring, str activation) -> Tensor
      x [N, dim]; weight [dim, W]; bias [dim] (weight's dtype); conv_state [S, dim, W-1]
      (the last W-1 committed inputs of a slot, oldest first; x's dtype); ring [M >= N, dim]
      (x's dtype; row n <- x[n]); activation "silu" | "none". Row j of request i is
      act(bias + sum_w weight[:, w] * window[w]), window = the last W entries of
      [conv_state[slot_i], rows 0..j of request i]. Returns [N, dim] in x's dtype.

    dspark::causal_conv1d_commit(Tensor(a!) conv_state, Tensor ring,
        Tensor query_start_loc, Tensor slots, Tensor accept_lens) -> ()
      conv_state[slot_i] <- last W-1 of [conv_state[slot_i], ring rows 0..a_i-1 of request i].

    dspark::gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta,
        Tensor recurrent_state, Tensor query_start_loc, Tensor slots, Tensor(a!) ring_k,
        Tensor(b!) ring_v, Tensor(c!) ring_g, Tensor(d!) ring_beta, float scale,
        bool use_qk_l2norm) -> Tensor
      q, k [N, Hk, K]; v [N, Hv, V] (Hv a multiple of Hk: value head h reads key head
      h // (Hv/Hk)); g (log decay) [N, Hv], or [N, Hv, K] with one gate a key channel (Kimi
      Linear's KDA); beta [N, Hv]; recurrent_state [S, Hv, K, V] float32.
      Per token, from S = recurrent_state[slot_i]: q, k <- l2norm (eps 1e-6) if use_qk_l2norm;
      S <- S * exp(g) (row k of S by exp(g[k]) with channel gates); delta = beta * (v - S^T k);
      S <- S + k (x) delta; out = S^T (q * scale). Returns [N, Hv, V] in q's dtype.

    dspark::gated_delta_rule_commit(Tensor(a!) recurrent_state, Tensor ring_k, Tensor ring_v,
        Tensor ring_g, Tensor ring_beta, Tensor query_start_loc, Tensor slots,
        Tensor accept_lens) -> ()
      recurrent_state[slot_i] <- the state after replaying rows 0..a_i-1 of request i.

GDN ring layout (all float32, contiguous, M >= N rows; :func:`gdn_ring` allocates it):
``ring_k [M, Hk, K]`` the *normalized* keys (what the update used, before any scale),
``ring_v [M, Hv, V]``, ``ring_g`` shaped like g's rows (``[M, Hv]`` or ``[M, Hv, K]``),
``ring_beta [M, Hv]``. Float32 holds bf16/fp16
inputs exactly, so the commit replays the forward's arithmetic on the forward's own operands;
q is not saved (the commit produces no output). Conv ring: ``[M, dim]`` in x's dtype.

Slots of non-empty requests must lie in ``[0, S)`` and, for the commits, be distinct: the
references check it (they sync anyway); the kernels never touch a pool row outside it.
The ``*_triton`` ops take the same arguments; their host wrappers raise ``ValueError`` on a
bad shape, dtype or device before any launch and never read a device value (CUDA-graph
safe). The Triton conv supports widths 2..4 (the reference any width >= 2).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import linear_attention_reference as ref
from .ssd import SSD_RAGGED_OPS

__all__ = ["causal_conv1d", "causal_conv1d_commit", "gated_delta_rule",
           "gated_delta_rule_commit", "conv_ring", "gdn_ring", "LINEAR_RAGGED_OPS"]


def conv_ring(max_rows: int, dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Replay ring of ``dspark::causal_conv1d``: ``[max_rows, dim]`` of the inputs' dtype."""
    return torch.zeros(max_rows, dim, dtype=dtype, device=device)


def gdn_ring(max_rows: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
             device, channel_gates: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replay rings of ``dspark::gated_delta_rule``: ``(ring_k, ring_v, ring_g, ring_beta)``;
    ``channel_gates``: g has one gate a key channel (``ring_g [M, Hv, K]``)."""
    f32 = dict(dtype=torch.float32, device=device)
    gates = (num_v_heads, k_dim) if channel_gates else (num_v_heads,)
    return (torch.zeros(max_rows, num_k_heads, k_dim, **f32),
            torch.zeros(max_rows, num_v_heads, v_dim, **f32),
            torch.zeros(max_rows, *gates, **f32), torch.zeros(max_rows, num_v_heads, **f32))


# ---------------------------------------------------------------- reference ops (any device)

@torch.library.custom_op("dspark::causal_conv1d", mutates_args=("ring",))
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                  slots: torch.Tensor, ring: torch.Tensor, activation: str) -> torch.Tensor:
    """Ragged causal depthwise conv1d. x ``[N, dim]`` -> ``[N, dim]``; saves x in ``ring``."""
    return ref.causal_conv1d(x, weight, bias, conv_state, query_start_loc, slots, ring,
                             activation)


@causal_conv1d.register_fake
def _(x, weight, bias, conv_state, query_start_loc, slots, ring, activation):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dspark::causal_conv1d_commit", mutates_args=("conv_state",))
def causal_conv1d_commit(conv_state: torch.Tensor, ring: torch.Tensor,
                         query_start_loc: torch.Tensor, slots: torch.Tensor,
                         accept_lens: torch.Tensor) -> None:
    """Advance each request's conv window by its accepted prefix (in place)."""
    ref.causal_conv1d_commit(conv_state, ring, query_start_loc, slots, accept_lens)


@causal_conv1d_commit.register_fake
def _(conv_state, ring, query_start_loc, slots, accept_lens):
    return None


@torch.library.custom_op("dspark::gated_delta_rule",
                         mutates_args=("ring_k", "ring_v", "ring_g", "ring_beta"))
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, recurrent_state: torch.Tensor,
                     query_start_loc: torch.Tensor, slots: torch.Tensor,
                     ring_k: torch.Tensor, ring_v: torch.Tensor, ring_g: torch.Tensor,
                     ring_beta: torch.Tensor, scale: float,
                     use_qk_l2norm: bool) -> torch.Tensor:
    """Ragged gated delta rule. q, k ``[N, Hk, K]``, v ``[N, Hv, V]`` -> ``[N, Hv, V]``."""
    return ref.gated_delta_rule(q, k, v, g, beta, recurrent_state, query_start_loc, slots,
                                ring_k, ring_v, ring_g, ring_beta, scale, use_qk_l2norm)


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, recurrent_state, query_start_loc, slots, ring_k, ring_v, ring_g,
      ring_beta, scale, use_qk_l2norm):
    return q.new_empty(v.shape[0], v.shape[1], v.shape[2])


@torch.library.custom_op("dspark::gated_delta_rule_commit", mutates_args=("recurrent_state",))
def gated_delta_rule_commit(recurrent_state: torch.Tensor, ring_k: torch.Tensor,
                            ring_v: torch.Tensor, ring_g: torch.Tensor,
                            ring_beta: torch.Tensor, query_start_loc: torch.Tensor,
                            slots: torch.Tensor, accept_lens: torch.Tensor) -> None:
    """Advance each request's recurrent state by its accepted prefix (in place)."""
    ref.gated_delta_rule_commit(recurrent_state, ring_k, ring_v, ring_g, ring_beta,
                                query_start_loc, slots, accept_lens)


@gated_delta_rule_commit.register_fake
def _(recurrent_state, ring_k, ring_v, ring_g, ring_beta, query_start_loc, slots, accept_lens):
    return None


LINEAR_RAGGED_OPS = (torch.ops.dspark.causal_conv1d, torch.ops.dspark.causal_conv1d_commit,
                     torch.ops.dspark.gated_delta_rule,
                     torch.ops.dspark.gated_delta_rule_commit, *SSD_RAGGED_OPS)
"""Op packets of the hybrid-layer ragged families, Mamba-2's (``ops/ssd.py``) included (to
join ``ops.RAGGED_OPS``)."""
