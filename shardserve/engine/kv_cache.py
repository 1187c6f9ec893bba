"""Sizing and allocating the paged KV cache on one rank.

A model's cache is one tensor [layers, planes, slots, heads, dim] (slot = block * block_size + offset): by default
two planes, keys and values, of the rank's KV heads (config.CacheLayout.keys_and_values); a model with another cache
declares its layout (`cache_layout()`): DeepSeek's latent attention keeps one plane of one "head", the token's
latent and rotated key together (models/deepseek_v3.py).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GB = 2.0


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    planes: int = 2) -> int:
    return planes * num_layers * block_size * kv_heads * head_dim * dtype.itemsize


def kv_cache_budget_bytes(device: torch.device, kv_cache_memory_gb: float | None, gpu_memory_utilization: float) -> int:
    if kv_cache_memory_gb is not None:
        return int(kv_cache_memory_gb * 2**30)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free
        return max(0, int(total * gpu_memory_utilization) - used_elsewhere)
    return int(DEFAULT_CPU_KV_CACHE_GB * 2**30)


def agree_on_num_blocks(local_blocks: int, group: dist.ProcessGroup | None, world_size: int) -> int:
    """Every rank must use the same block count: take the smallest any rank can hold."""
    if world_size == 1:
        return local_blocks
    t = torch.tensor([local_blocks], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device, planes: int = 2) -> list[tuple[torch.Tensor, ...]]:
    """One (keys, values) pair per layer (`planes` tensors: 2 by default), each [num_blocks * block_size, kv_heads,
    head_dim].

    Left uninitialised (zero-filling gigabytes takes seconds) except block 0: padded attention reads
    point there, and although they are masked out, a NaN in their values would still poison the sum.
    """
    cache = torch.empty(num_layers, planes, num_blocks * block_size, kv_heads, head_dim, dtype=dtype, device=device)
    return kv_cache_layers(cache, block_size)


def kv_cache_layers(cache: torch.Tensor, block_size: int) -> list[tuple[torch.Tensor, ...]]:
    """Per-layer views of a whole cache [layers, planes, slots, heads, dim], a tuple of its planes each ((keys,
    values) for two), block 0 zeroed."""
    cache[:, :, :block_size].zero_()
    return [tuple(cache[i, p] for p in range(cache.shape[1])) for i in range(cache.shape[0])]
