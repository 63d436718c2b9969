"""The mixture-of-experts ``dspark::`` ops: routing, the grouped up projection (with its gate)
and the grouped down projection with the combine; schema, fake and reference.

A layer's experts run as three ops over the packed token rows (the router's top-k before them,
and shared experts beside them, stay the model's own token-wise graph code)::

    %order, %offsets = dspark.experts_route(%ids, %query_start_loc, E)
    %h = dspark.experts_up(%x, %order, %offsets, %w_up, %b_up, transposed, 'silu_glu')
    %h = <the model's own gate on %h>                       # only when activation='none'
    %out = dspark.experts_down(%h, %order, %offsets, %weights, %w_down, %b_down, transposed)

Schemas (``dspark::experts_*_triton`` in ``kernels/ops.py`` take the same arguments)::

    dspark::experts_route(Tensor ids, Tensor? query_start_loc, int num_experts)
        -> (Tensor order, Tensor offsets)
      ids [N, K] int (each token's chosen experts). order [N*K] int32: the pairs p = n*K + k
      sorted by expert, stable, pairs routed nowhere last; offsets [E] int32: where each
      expert's pairs end in order (offsets[E-1]: the routed pairs). A pair routes nowhere
      when its id is outside [0, E) or its token is padding (n >= query_start_loc[R]; None:
      every row is real).

    dspark::experts_up(Tensor x, Tensor order, Tensor offsets, Tensor w, Tensor? bias,
        bool transposed, str activation) -> Tensor
      x [N, D] in w's dtype; w [E, F, D] ([E, D, F] when transposed); bias [E, F].
      Returns [N*K, F'] in pair order: activation(x[n] @ W[e].T + b[e]) (F' = F, or F // 2
      under a GLU gate: experts_reference.ACTIVATIONS); zeros for pairs routed nowhere.

    dspark::experts_down(Tensor h, Tensor order, Tensor offsets, Tensor weights, Tensor w,
        Tensor? bias, bool transposed) -> Tensor
      h [N*K, I] in pair order (w's dtype); weights [N, K] (routing weights); w [E, D, I]
      ([E, I, D] when transposed); bias [E, D]. Returns [N, D] in promote(w, weights):
      sum over k of weights[n, k] * (h[p] @ W[e].T + b[e]); padded rows come out zero.

Shapes depend on ``N``, ``K`` and the weights only (never on the routing), so every op runs in
a tier's CUDA graph with no host sync; padded rows route nowhere, read no weights and add
nothing. Arithmetic: :mod:`dspark_compile.ops.experts_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import experts_reference as ref

__all__ = ["experts_route", "experts_up", "experts_down", "route_fake", "up_fake",
           "down_fake", "down_dtype", "EXPERTS_OPS"]


@torch.library.custom_op("dspark::experts_route", mutates_args=())
def experts_route(ids: torch.Tensor, query_start_loc: Optional[torch.Tensor],
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert: ``(order [N*K] int32, offsets [E] int32)``."""
    ref.check_route(ids, query_start_loc, num_experts)
    return ref.route(ids, query_start_loc, num_experts)


def route_fake(ids, query_start_loc, num_experts):
    ref.check_route(ids, query_start_loc, num_experts)
    return (ids.new_empty(ids.shape[0] * ids.shape[1], dtype=torch.int32),
            ids.new_empty(num_experts, dtype=torch.int32))


experts_route.register_fake(route_fake)


@torch.library.custom_op("dspark::experts_up", mutates_args=())
def experts_up(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor,
               bias: Optional[torch.Tensor], transposed: bool,
               activation: str) -> torch.Tensor:
    """Each routed pair's up projection (and gate): ``[N*K, F']`` in pair order."""
    ref.check_up(x, order, offsets, w, bias, transposed, activation)
    return ref.up(x, order, offsets, w, bias, transposed, activation)


def up_fake(x, order, offsets, w, bias, transposed, activation):
    ref.check_up(x, order, offsets, w, bias, transposed, activation)
    return x.new_empty(order.shape[0], ref.up_columns(w, transposed, activation))


experts_up.register_fake(up_fake)


def down_dtype(w: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    """``experts_down``'s result dtype: transformers multiplies the projection (in the weights'
    dtype) by the routing weights before the sum."""
    return torch.promote_types(w.dtype, weights.dtype)


@torch.library.custom_op("dspark::experts_down", mutates_args=())
def experts_down(h: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
                 weights: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor],
                 transposed: bool) -> torch.Tensor:
    """Each routed pair's down projection, weighted and summed per token: ``[N, D]``."""
    ref.check_down(h, order, offsets, weights, w, bias, transposed)
    return ref.down(h, order, offsets, weights, w, bias, transposed)


def down_fake(h, order, offsets, weights, w, bias, transposed):
    ref.check_down(h, order, offsets, weights, w, bias, transposed)
    out = w.shape[2] if transposed else w.shape[1]
    return h.new_empty(weights.shape[0], out, dtype=down_dtype(w, weights))


experts_down.register_fake(down_fake)


EXPERTS_OPS = (torch.ops.dspark.experts_route, torch.ops.dspark.experts_up,
               torch.ops.dspark.experts_down)
"""Op packets of the experts family: flat-native (token rows in, token rows out), so they
belong to ``ops.RAGGED_OPS`` from the capture on."""
