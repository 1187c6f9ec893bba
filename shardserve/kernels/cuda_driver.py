"""The CUDA driver API through ctypes: libcuda itself, its errors as exceptions, the device's primary context made
current, and a raw device range seen as a tensor. Address-stable memory (weights/stable_memory.py) and the peer
memory of the all-reduce (distributed/ipc_memory.py) both call the driver through these.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def driver():
    """libcuda through ctypes, or None where there is no NVIDIA driver."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def check(result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorString(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA driver error {result} ({(name.value or b'?').decode()})")


def make_context_current(ordinal: int) -> None:
    """The driver API acts on the calling thread's current context; use the device's primary one (torch's)."""
    drv = driver()
    device, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(drv.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    check(drv.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    check(drv.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")  # torch holds its own reference


class _CudaArrayView:
    """A raw device range in the form torch.as_tensor accepts without copying."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def device_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor viewing `nbytes` of device memory at `address` (no copy; the caller keeps it alive)."""
    return torch.as_tensor(_CudaArrayView(address, nbytes), device=device)
