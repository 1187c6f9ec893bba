"""Host-to-device copies of a step's small inputs that never wait for the device's queued work.

A non-blocking copy from pageable host memory may synchronize with the GPU's stream before it starts;
one from pinned memory is queued in stream order and returns at once. Every per-step input (token ids,
positions, slot tables, sampling rows) goes through these two, so a step can be queued while the one
before it still runs.
"""

from __future__ import annotations

import torch


def pinned(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list or array as a pinned tensor (to copy_ into a device buffer with non_blocking=True)."""
    return torch.as_tensor(values, dtype=dtype).pin_memory()


def on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list or array as a tensor on `device` (on a CPU, the tensor itself)."""
    if device.type == "cpu":
        return torch.as_tensor(values, dtype=dtype)
    return pinned(values, dtype).to(device, non_blocking=True)
