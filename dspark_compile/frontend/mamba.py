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

Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba; Zamba calls it once per head) call, with
``use_cache=False`` and outside training::

    mamba_selective_scan(x [bs, D, T], dt [bs, D, T], A [D, N], B [bs, N, T], C [bs, N, T],
                         D=[D], z=[bs, D, T], delta_bias=[D], delta_softplus=True,
                         return_last_state=False, use_mambapy=, use_associative_scan=)

a scan whose decay ``exp(A[c, s] * dt[c])`` differs per (channel c, state channel s).
:func:`selective_scan` runs it as ``dspark::ssd`` with one Mamba-2 head per pair (head
``s * D + c``, P = 1, one state channel, B and C of group ``s``): the same recurrence, each
head's decay a scalar again. The sum over ``s`` of the heads' outputs, the ``D`` skip and the
``silu(z)`` gate are token-wise graph code. Exact, but not compact: the heads' replay rings hold
``D * N`` floats a row (Falcon-Mamba-7B: 8192 x 16, 512 KB a row per ring), and the GPU kernel
runs one state element per program; :func:`selective_scan` says so once in the log.
``mamba_inner_fn`` (training only) and ``mamba_selective_state_update`` (with a cache only)
are refused naming the module (:data:`REFUSED`).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from .recurrent import RecurrentLayers

__all__ = ["chunk_scan", "selective_state_update", "selective_scan", "refuse_mamba1", "REPLACED",
           "REFUSED"]

log = logging.getLogger("dspark_compile")

REPLACED = ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba_selective_scan")
"""Mamba-2 functions the capture replaces (the second one runs only with a cache), and the
Mamba-1 scan."""
REFUSED = ("mamba_inner_fn", "mamba_selective_state_update")
"""Mamba-1 functions of training and of a cache: a module that calls one is refused by name."""
_SAID: set[str] = set()
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


def selective_scan(layers: RecurrentLayers, hidden_states, dt, A, B, C, D=None, z=None,
                   delta_bias=None, delta_softplus=False, return_last_state=False,
                   use_mambapy=False, use_associative_scan=False, **kwargs):
    """Replacement of ``mamba_selective_scan``: ``[bs, D, T]`` (see the module docstring).
    ``use_mambapy`` / ``use_associative_scan`` pick HF's algorithm, not the result."""
    site = layers.site("mamba_selective_scan", scan=True)
    if return_last_state:
        raise NotImplementedError(
            f"{site.where} asks for its last state; dspark::ssd owns the state (the capture "
            "runs use_cache=False), so this call is refused")
    bs, d, t = hidden_states.shape
    n = A.shape[-1] if A.dim() == 2 else -1
    if A.shape != (d, n) or dt.shape != (bs, d, t) or B.shape != (bs, n, t) or \
            C.shape != B.shape:
        raise NotImplementedError(
            f"{site.where}: x {tuple(hidden_states.shape)}, dt {tuple(dt.shape)}, A "
            f"{tuple(A.shape)}, B {tuple(B.shape)}, C {tuple(C.shape)}; the capture takes x and "
            "dt [bs, D, T], A [D, N] and B, C [bs, N, T]")
    if site.where not in _SAID:
        _SAID.add(site.where)
        log.info("dspark_compile: %s runs as %d one-element Mamba-2 heads (D=%d x N=%d): "
                 "exact, but its replay rings hold D*N floats a row and its GPU kernel one "
                 "state element a program", site.where, d * n, d, n)
    h = n * d  # head s * D + c: state channel s of channel c
    x = hidden_states.transpose(1, 2)[:, :, None, :].expand(bs, t, n, d).reshape(bs, t, h, 1)
    dts = dt.transpose(1, 2)[:, :, None, :].expand(bs, t, n, d).reshape(bs, t, h)
    if site.discovering:
        layers.record(site, "ssd", (h, 1, 1), repeats=True)
        out = x.new_zeros(x.shape, dtype=torch.float32)
    else:
        groups = (B.transpose(1, 2)[..., None], C.transpose(1, 2)[..., None])  # [bs, T, N, 1]
        bias = None if delta_bias is None else delta_bias.repeat(n)
        out = site.scope.ssd(site.layer, x, dts, A.transpose(0, 1).reshape(h), *groups, None,
                             bias, bool(delta_softplus), -math.inf, math.inf)
    y = out.reshape(bs, t, n, d).sum(dim=2).transpose(1, 2)  # [bs, D, T]
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y


def refuse_mamba1(name: str):
    """A replacement of Mamba-1 function ``name`` that refuses the calling module."""
    def refuse(layers: RecurrentLayers, *args, **kwargs):
        site = layers.site(name)
        raise NotImplementedError(
            f"{site.where} runs outside inference with use_cache=False (training's fused "
            "Mamba-1 path, or a cache's one-token update); dspark_compile captures "
            "mamba_selective_scan, so the model is refused")
    return refuse
