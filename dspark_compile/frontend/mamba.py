"""Hugging Face Mamba-2 mixers: ``mamba2_chunk_scan`` routed to ``dspark::dense_ssd``.

Every Mamba-2 family of transformers 5.x (Mamba2, Bamba, Falcon-H1, GraniteMoeHybrid,
Nemotron-H, Zamba2) runs a mixer whose forward, with ``use_cache=False``, calls two
module-level functions of its modeling module::

    causal_conv1d_fn(xBC [bs, conv_dim, T], weight [conv_dim, W], bias, activation="silu")
    mamba2_chunk_scan(x [bs, T, H, P], dt [bs, T, H], A [H], B [bs, T, G, N],
                      C [bs, T, G, N], chunk_size=, D=, z=None, dt_bias=, dt_softplus=True,
                      dt_limit=(lo, hi), initial_states=None, return_final_states=False,
                      **model_kwargs) -> out [bs, T, H, P] float32

(the gate, the grouped RMS norm, Falcon-H1's multipliers and the projections around them are
token-wise). The conv goes through ``frontend/hybrid.py``'s replacement; :func:`chunk_scan`
replaces the scan. What changes the scan's result is whitelisted: ``D``, ``dt_bias``,
``dt_softplus`` and ``dt_limit`` become the op's arguments; ``z``, ``seq_idx``, ``cu_seqlens``
and ``initial_states`` must be None and ``return_final_states`` False (the capture owns the
state), or the mixer is refused naming the module. Other keywords are the model's own forward
keywords passed through (``position_embeddings``, ``output_router_logits``): HF's fallback
ignores them, and so does the capture.

Mamba-1 selective scans (Mamba, Falcon-Mamba, Jamba, Zamba) call ``mamba_selective_scan`` /
``mamba_inner_fn``; :data:`REFUSED` names them and their replacement refuses the module.
"""

from __future__ import annotations

import math

import torch

from .recurrent import RecurrentLayers

__all__ = ["chunk_scan", "selective_state_update", "refuse_mamba1", "REPLACED", "REFUSED"]

REPLACED = ("mamba2_chunk_scan", "mamba2_selective_state_update")
"""Mamba-2 functions the capture replaces (the second one runs only with a cache)."""
REFUSED = ("mamba_selective_scan", "mamba_inner_fn", "mamba_selective_state_update")
"""Mamba-1 functions: a module that calls one is refused by name."""
_MUST_BE_NONE = ("z", "seq_idx", "cu_seqlens", "initial_states")


def chunk_scan(layers: RecurrentLayers, hidden_states, dt, A, B, C, chunk_size=None, D=None,
               dt_bias=None, initial_states=None, dt_softplus=False,
               dt_limit=(0.0, math.inf), return_final_states=False, **kwargs):
    """Replacement of ``mamba2_chunk_scan``: ``[bs, T, H, P]`` float32 (see module docstring)."""
    site = layers.site("mamba2_chunk_scan")
    given = {"initial_states": initial_states, **kwargs}
    set_ = [k for k in _MUST_BE_NONE if given.get(k) is not None]
    if set_ or return_final_states:
        raise NotImplementedError(
            f"{site.where} passes {set_ or ['return_final_states=True']}; dspark::ssd "
            "implements the scan with z, seq_idx, cu_seqlens and initial_states None and no "
            "final state returned (the capture runs use_cache=False and owns the state)")
    bs, t, h, p = hidden_states.shape
    if B.dim() != 4 or C.shape != B.shape or dt.shape != (bs, t, h) or h % B.shape[2]:
        raise NotImplementedError(
            f"{site.where}: x {tuple(hidden_states.shape)}, dt {tuple(dt.shape)}, B "
            f"{tuple(B.shape)}, C {tuple(C.shape)}; dspark::ssd needs x [bs, T, H, P], dt "
            "[bs, T, H] and B, C [bs, T, G, N] with H a multiple of G")
    lo, hi = (float(v) for v in dt_limit)
    if site.discovering:
        layers.record(site, "ssd", (h, int(B.shape[3]), p))
        return hidden_states.new_zeros(hidden_states.shape, dtype=torch.float32)
    return site.scope.ssd(site.layer, hidden_states, dt, A, B, C, D, dt_bias,
                          bool(dt_softplus), lo, hi)


def selective_state_update(layers: RecurrentLayers, *args, **kwargs):
    """``mamba2_selective_state_update`` runs only with a cache; the capture runs without."""
    site = layers.site("mamba2_selective_state_update")
    raise RuntimeError(
        f"{site.where} was called during a dspark_compile capture; the capture runs the model "
        "with use_cache=False, so a mixer that still calls it keeps its own cache")


def refuse_mamba1(name: str):
    """A replacement of Mamba-1 function ``name`` that refuses the calling module."""
    def refuse(layers: RecurrentLayers, *args, **kwargs):
        site = layers.site(name)
        raise NotImplementedError(
            f"{site.where}: a Mamba-1 selective scan (per-channel decay over a [d_inner, "
            "d_state] state) has no dspark:: ragged op; dspark_compile implements Mamba-2 "
            "(mamba2_chunk_scan), Gated DeltaNet and short-conv mixers, so the model is refused")
    return refuse
