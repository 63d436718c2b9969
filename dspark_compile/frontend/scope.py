"""The capture scope: what a cached-attention layer sees while its model is being captured.

During capture the frontend opens a scope holding the (fake) paged KV pools and the dense
verify metadata; every cached-attention call in the model (HF's attention interface or
``dspark_compile.nn.CachedAttention``) reads it and emits one ``dspark::dense_cached_attention``
node. The scope is a ``ContextVar`` set and reset around the capture, never a module global
that outlives it.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

from ..lowering import ops  # noqa: F401  (registers the dspark:: ops)

__all__ = ["CaptureScope", "active_scope", "open_scope"]


@dataclass
class CaptureScope:
    """Pools and metadata of one dense verify capture."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per attention layer, in pool order: K and V pools ``[pages, page_size, Hkv, D]``."""
    block_table: torch.Tensor
    """int32 ``[bs, pages_per_request]``: page ids of each dense request."""
    context_lens: torch.Tensor
    """int32 ``[bs]``: committed tokens of each dense request."""
    pool_index: dict[object, int] = field(default_factory=dict)
    """Layer key (HF ``layer_idx`` or module id) -> pool index."""

    def attend(self, key: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Dense cached attention of layer ``key``: q ``[bs, H, T, D]`` -> ``[bs, T, H, D]``."""
        if key not in self.pool_index:
            raise RuntimeError(
                f"cached-attention layer {key!r} was called during capture but has no KV pool; "
                f"known layers: {sorted(map(str, self.pool_index))}"
            )
        k_cache, v_cache = self.kv_caches[self.pool_index[key]]
        return torch.ops.dspark.dense_cached_attention(
            q, k, v, k_cache, v_cache, self.block_table, self.context_lens, float(scale)
        )


_ACTIVE: contextvars.ContextVar[CaptureScope | None] = contextvars.ContextVar(
    "dspark_capture_scope", default=None
)


def active_scope() -> CaptureScope | None:
    """The scope of the capture in progress, or None outside a capture."""
    return _ACTIVE.get()


@contextlib.contextmanager
def open_scope(scope: CaptureScope):
    """Make ``scope`` the active one for the duration of a capture."""
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)
