"""Attention over the paged KV cache, behind one interface with a backend per kind of hardware.

A backend turns a step's batch into its own metadata (`build_metadata`) and computes attention for
one layer (`forward`). `create_attention_backend` picks one at start-up: Triton paged kernels on
CUDA GPUs, torch SDPA elsewhere (CPUs, or layouts the kernels don't cover).
"""

from __future__ import annotations

import torch

from shardserve.attention.batch import StepBatch
from shardserve.attention.sdpa import SdpaBackend
from shardserve.kernels.availability import use_triton

__all__ = ["StepBatch", "create_attention_backend"]


def create_attention_backend(device: torch.device, block_size: int, num_heads: int, num_kv_heads: int,
                             kv_index: tuple[int, ...]):
    """The backend for this device and head layout; start-up checks it (engine/kernel_setup.py) and logs it
    in the kernel plan line. Where RoPE turns only the first dims of each head (Qwen3-Next), the Triton backend
    rotates those apart from its fused rotation (TritonPagedBackend.forward)."""
    group = num_heads // num_kv_heads if num_heads % num_kv_heads == 0 else 0
    grouped = group > 0 and kv_index == tuple(i // group for i in range(num_heads))
    if use_triton(torch.empty(0, device=device)) and grouped:
        from shardserve.attention.triton_paged import TritonPagedBackend

        backend = TritonPagedBackend(device, block_size, num_kv_heads)
    else:
        backend = SdpaBackend(device, block_size)
    return backend
