"""The ``dspark::`` custom ops: schema, fake (meta) implementation and pure-torch reference.

Importing this package registers every reference op. Their Triton twins live in
``dspark_compile.kernels.ops``; the rewrites that introduce them live in ``passes/``.
"""

from __future__ import annotations

import torch

from . import (attention, compressed, dense_linear_attention, experts, linear, linear_attention,
               sparse, ssd)
from .linear_attention import LINEAR_RAGGED_OPS

__all__ = ["RAGGED_OPS", "DENSE_OPS", "LINEAR_RAGGED_OPS", "attention", "linear",
           "linear_attention", "dense_linear_attention", "ssd", "experts", "compressed", "sparse"]

RAGGED_OPS = (torch.ops.dspark.ragged_attention, *LINEAR_RAGGED_OPS, *experts.EXPERTS_OPS,
              *compressed.COMPRESSED_RAGGED_OPS, *sparse.SPARSE_RAGGED_OPS)
"""Op packets of the ragged families (what the packed graph may contain). The experts ops are
flat-native from the capture on: the capture emits them over ``[bs*T]`` rows and
``ragged_experts`` gives their routing the layout's real-row bound."""
DENSE_OPS = (torch.ops.dspark.dense_cached_attention,
             *dense_linear_attention.DENSE_LINEAR_OPS, *compressed.COMPRESSED_DENSE_OPS,
             *sparse.SPARSE_DENSE_OPS)
"""Op packets of the dense families (what a capture emits and the passes must rewrite)."""
