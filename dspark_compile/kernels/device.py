"""The one device helper of the kernels: a device's target entry and multiprocessor count."""

from __future__ import annotations

import functools

import torch

from .targets import TargetConfig, target_for_device

__all__ = ["device_target", "device_sm_count"]


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
