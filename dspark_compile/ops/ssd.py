"""The Mamba-2 (SSD) ``dspark::`` ops: ragged selective-state update with rollback, its commit,
and the dense form a capture emits.

transformers' Mamba-2 mixers (Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid, Nemotron-H, Zamba2)
mix tokens through ``causal_conv1d_fn`` (the ragged conv of ``ops/linear_attention.py``) and
``mamba2_chunk_scan``; these ops are the scan's packed-ragged form. Layout as everywhere
(DESIGN.md, Core contracts): request ``i`` owns rows ``query_start_loc[i] :
query_start_loc[i+1]``; rows past ``query_start_loc[R]`` are padding (zeros out, nothing
saved); ``slots[i]`` is its state-pool row.

The state is a gated linear attention's: ``S [H, N_state, P]`` per slot, B as the key, ``x *
dt`` as the value, C as the query (the layout of the Gated DeltaNet pools, ``[Hv, K, V]``, so
both share ``LinearPools``). Arithmetic and op order: :mod:`dspark_compile.ops.ssd_reference`.

Rollback through a replay ring, as for the gated delta rule: the forward only *reads* the pool
and saves what each row's update used; the commit replays each request's first
``clamp(accept_lens[i], 0, len_i)`` rows onto its slot in place. A rejected draft's row is never
replayed, so whatever it holds (NaN included) never reaches the committed state.

Schemas (the reference ops; ``dspark::ssd_triton`` / ``ssd_commit_triton`` in
``kernels/ops.py`` take the same arguments on CUDA and ROCm)::

    dspark::ssd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? dt_bias,
        Tensor ssm_state, Tensor query_start_loc, Tensor slots, Tensor(a!) ring_x,
        Tensor(b!) ring_b, Tensor(c!) ring_da, bool dt_softplus, float dt_min,
        float dt_max) -> Tensor
      x [N, H, P]; dt [N, H] (raw, before bias/softplus); A [H] (negative decay rates, HF's
      -exp(A_log)); B, C [N, G, N_state] (H a multiple of G); D, dt_bias [H] or None;
      ssm_state [S, H, N_state, P] float32. Returns [N, H, P] float32 (what HF's fallback
      returns, whatever x's dtype).

    dspark::ssd_commit(Tensor(a!) ssm_state, Tensor ring_x, Tensor ring_b, Tensor ring_da,
        Tensor query_start_loc, Tensor slots, Tensor accept_lens) -> ()

    dspark::dense_ssd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D,
        Tensor? dt_bias, Tensor ssm_state, Tensor slots, bool dt_softplus, float dt_min,
        float dt_max) -> Tensor
      x [bs, T, H, P]; dt [bs, T, H]; B, C [bs, T, G, N_state] (the layout HF's
      mamba2_chunk_scan takes); every request runs T rows from its slot. Returns
      [bs, T, H, P] float32. Only reads the pool (the dense graph is the passes' starting
      point, not a serving path).

Ring layout (float32, contiguous, M >= N rows; :func:`ssd_ring` allocates it): ``ring_x [M,
H, P]`` holds ``x * dt`` (the update's own operand), ``ring_b [M, G, N_state]``, ``ring_da
[M, H]`` holds ``A * dt``. The commit replays the forward's arithmetic on the forward's operands,
so the committed state is bitwise the forward's state after the accepted rows.

Slots of non-empty requests must lie in ``[0, S)`` and, for the commit, be distinct.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ssd_reference as ref

__all__ = ["ssd", "ssd_commit", "dense_ssd", "ssd_ring", "SSD_RAGGED_OPS", "SSD_DENSE_OPS"]


def ssd_ring(max_rows: int, num_heads: int, num_groups: int, state_dim: int, head_dim: int,
             device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replay rings of ``dspark::ssd``: ``(ring_x [M, H, P], ring_b [M, G, N], ring_da [M, H])``."""
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.zeros(max_rows, num_heads, head_dim, **f32),
            torch.zeros(max_rows, num_groups, state_dim, **f32),
            torch.zeros(max_rows, num_heads, **f32))


@torch.library.custom_op("dspark::ssd", mutates_args=("ring_x", "ring_b", "ring_da"))
def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], ssm_state: torch.Tensor,
        query_start_loc: torch.Tensor, slots: torch.Tensor, ring_x: torch.Tensor,
        ring_b: torch.Tensor, ring_da: torch.Tensor, dt_softplus: bool, dt_min: float,
        dt_max: float) -> torch.Tensor:
    """Ragged Mamba-2 scan. x ``[N, H, P]`` -> ``[N, H, P]`` float32; saves the replay rows."""
    return ref.ssd(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, slots, ring_x,
                   ring_b, ring_da, dt_softplus, dt_min, dt_max)


@ssd.register_fake
def _(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, slots, ring_x, ring_b, ring_da,
      dt_softplus, dt_min, dt_max):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("dspark::ssd_commit", mutates_args=("ssm_state",))
def ssd_commit(ssm_state: torch.Tensor, ring_x: torch.Tensor, ring_b: torch.Tensor,
               ring_da: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor,
               accept_lens: torch.Tensor) -> None:
    """Advance each request's SSM state by its accepted prefix (in place)."""
    ref.ssd_commit(ssm_state, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens)


@ssd_commit.register_fake
def _(ssm_state, ring_x, ring_b, ring_da, query_start_loc, slots, accept_lens):
    return None


@torch.library.custom_op("dspark::dense_ssd", mutates_args=())
def dense_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
              ssm_state: torch.Tensor, slots: torch.Tensor, dt_softplus: bool, dt_min: float,
              dt_max: float) -> torch.Tensor:
    """Dense Mamba-2 scan from each request's pool row: ``[bs, T, H, P]`` float32."""
    bs, t, h, p = x.shape
    g, n_state = B.shape[2:]
    n = bs * t
    qsl = (torch.arange(bs + 1, device=x.device, dtype=torch.int64) * t).to(torch.int32)
    rings = ssd_ring(n, h, g, n_state, p, x.device)  # scratch: never replayed
    out = ref.ssd(x.reshape(n, h, p), dt.reshape(n, h), A, B.reshape(n, g, n_state),
                  C.reshape(n, g, n_state), D, dt_bias, ssm_state, qsl, slots, *rings,
                  dt_softplus, dt_min, dt_max)
    return out.view(bs, t, h, p)


@dense_ssd.register_fake
def _(x, dt, A, B, C, D, dt_bias, ssm_state, slots, dt_softplus, dt_min, dt_max):
    return x.new_empty(x.shape, dtype=torch.float32)


SSD_RAGGED_OPS = (torch.ops.dspark.ssd, torch.ops.dspark.ssd_commit)
"""Op packets of the ragged SSD family (joins ``LINEAR_RAGGED_OPS``)."""
SSD_DENSE_OPS = (torch.ops.dspark.dense_ssd,)
"""Op packets of the dense SSD family (joins ``DENSE_LINEAR_OPS``)."""
