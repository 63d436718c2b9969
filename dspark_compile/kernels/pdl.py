"""Programmatic dependent launch (PDL) for the lowering's Triton kernels (sm_90 and newer).

A verify step at a few tokens is a chain of short kernels, each a few microseconds, and each
boundary costs the launch of the next grid plus the ramp of its first loads. With PDL a kernel
is launched with ``launch_pdl=True`` (CUDA's programmatic stream serialization) and may start
while the one before it in the stream still runs:

- every such kernel calls :func:`pdl_enter` first: ``griddepcontrol.wait`` (returns once the
  kernel before it has finished and its writes are visible), then
  ``griddepcontrol.launch_dependents`` (the next PDL kernel may be scheduled once every program
  of this one has got here). Nothing a kernel reads or writes that another kernel touches comes
  before the wait, so the stream's order is kept (one exception, next). A kernel of many waves
  (the experts GEMM) waits first (:func:`pdl_wait`) and releases the next one only near its end
  (:func:`pdl_release`), so that kernel's programs do not take places its own later waves need;
- so when a PDL kernel starts, every launch before the one just before it has finished. The
  attention kernel uses that (``EARLY``, ``TargetConfig.attn_early_reads``): where the graph
  shows that the launch just before it cannot write them (``select.early_attention_reads``),
  it reads its request bounds, block-table row and first K/V tile before the wait, so that
  chain of dependent loads overlaps the q/k/v launch. The skinny kernel, likewise, loads its
  first weight tile(s) into registers before the wait where the weight is settled
  (``select.settled_weight``) and the rows few (``TargetConfig.skinny_early_w_max_m``).
  Neither writes anything before the wait;
- in the other kernels nothing comes before :func:`pdl_enter`. Asking L2 for a program's own
  weight rows there (weights are never written in a step) measured slower at every length on
  the H200: a fused layer's four matmuls took 47.4 us at 3 rows without it, 48.3-61.3 with
  256-2048 of K a row (skinny_pdl.json, the option as it was at c416b87); so did asking for
  the next kernel's weight (88d3777). One tile in registers is what won;
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

__all__ = ["pdl_enter", "pdl_wait", "pdl_release", "use_pdl", "pdl_options"]


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before this one, then let the next one be scheduled (no-op unless
    ``PDL``)."""
    pdl_wait(PDL)
    pdl_release(PDL)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """:func:`pdl_enter`'s wait alone, for a kernel that lets the next one be scheduled later
    (:func:`pdl_release`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel be scheduled once every program got here (or exited). A kernel of
    many waves calls it near its end: released at the start, the next kernel's programs are
    placed while waves remain and sit at their wait on the multiprocessors those waves need."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def use_pdl(device: torch.device, cfg: TargetConfig) -> bool:
    """Launch with PDL: the target allows it and ``device`` is a CUDA (not ROCm) GPU."""
    return bool(cfg.pdl) and device.type == "cuda" and torch.version.hip is None


def pdl_options(pdl: bool) -> dict:
    """Launch keyword arguments of a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}
