"""The device helpers of the kernels: a device's target entry and multiprocessor count, and the
precision of their float32 dots."""

from __future__ import annotations

import functools

import torch

from .targets import TargetConfig, target_for_device

__all__ = ["device_target", "device_sm_count", "fp32_dot_precision", "register_cap"]


@functools.lru_cache(maxsize=None)  # asked once per device
def device_sm_count(device: torch.device) -> int:
    """Multiprocessors of a device (the target table's default under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return target_for_device(device).default_sm_count


@functools.lru_cache(maxsize=None)
def device_target(device: torch.device) -> tuple[TargetConfig, int]:
    """Target entry and multiprocessor count of a device."""
    return target_for_device(device), device_sm_count(device)


def fp32_dot_precision(cfg: TargetConfig) -> str:
    """``input_precision`` of ``tl.dot`` on float32 operands: the target's fast choice
    (``TargetConfig.fp32_dot_precision``, TF32 on NVIDIA) only where torch allows its own
    float32 matmuls TF32 (``torch.set_float32_matmul_precision("high")`` or ``"medium"``); at
    torch's default, ``"highest"``, IEEE float32 as cuBLAS computes the model's own float32
    matmuls. A float32 model then verifies as its float32 forward: TF32 attention moved logits
    by ~3e-4 on the tiny zoo models, enough to flip a near-tied expert choice downstream
    (``zoo --device cuda --variants``: two MoE variants off by 0.03 and 0.2)."""
    if cfg.fp32_dot_precision == "ieee" or torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return cfg.fp32_dot_precision


def register_cap(registers: int | None, cfg: TargetConfig, device: torch.device) -> dict:
    """Launch options capping a thread's registers (``maxnreg``) at ``registers``: NVIDIA only
    (the HIP backend rejects the option), none for 0 or None (the compiler's choice)."""
    if registers and cfg.backend == "cuda" and device.type == "cuda":
        return {"maxnreg": registers}
    return {}
