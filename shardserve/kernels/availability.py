"""Whether the Triton GPU kernels in shardserve/kernels/triton can be used for a tensor."""

from __future__ import annotations

import functools
import importlib.util

import torch

from shardserve import envs

DISABLE_ENV = envs.DISABLE_TRITON.name  # set to 1 to run CUDA models on plain torch ops


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_usable()


def triton_usable() -> bool:
    """Whether Triton kernels may run at all (importable, and not disabled by SHARDSERVE_DISABLE_TRITON)."""
    return _triton_importable() and not envs.DISABLE_TRITON.get()
