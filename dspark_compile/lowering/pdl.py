"""Programmatic dependent launch (PDL) for the lowering's Triton kernels (sm_90 and newer).

A verify step at a few tokens is a chain of short kernels, each a few microseconds, and each
boundary costs the launch of the next grid plus the ramp of its first loads. With PDL a kernel
is launched with ``launch_pdl=True`` (CUDA's programmatic stream serialization) and may start
while the one before it in the stream still runs:

- every such kernel calls :func:`pdl_enter` first: ``griddepcontrol.wait`` (returns once the
  kernel before it has finished and its writes are visible), then
  ``griddepcontrol.launch_dependents`` (the next PDL kernel may be scheduled once every program
  of this one has got here). Nothing a kernel reads or writes that another kernel touches comes
  before the wait, so the stream's order is kept;
- the work that depends on no earlier kernel may come before :func:`pdl_enter`: the skinny
  matmul asks L2 for the first part of its weight rows (:func:`l2_prefetch`; weights are never
  written in a step, and an L2 prefetch is only a hint to the cache every SM shares, so it cannot
  read a stale value);
- a kernel launched without PDL (Inductor's, cuBLAS) after one launched with it waits for it
  as usual, and a PDL kernel after an ordinary one starts when that one ends; so the chain is
  correct whatever runs between our kernels.

CUDA-graph capture keeps the programmatic edges (CUDA 12.3+). The switch is the target entry's
``pdl`` (on for ``sm_90``), used only on a CUDA device: never under the interpreter or ROCm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .targets import TargetConfig

__all__ = ["pdl_enter", "l2_prefetch", "use_pdl", "pdl_options"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the next one be scheduled (no-op unless
    ``PDL``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs, nbytes):
    """Ask L2 for ``nbytes`` (a multiple of 16) from each address in ``ptrs`` (16-byte aligned):
    one ``cp.async.bulk.prefetch.L2`` per element (sm_90). Nothing is returned or waited for."""
    size = tl.zeros(ptrs.shape, tl.int32) + nbytes
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0 unused",
                              "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def use_pdl(device: torch.device, cfg: TargetConfig) -> bool:
    """Launch with PDL: the target allows it and ``device`` is a CUDA (not ROCm) GPU."""
    return bool(cfg.pdl) and device.type == "cuda" and torch.version.hip is None


def pdl_options(pdl: bool) -> dict:
    """Launch keyword arguments of a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}
