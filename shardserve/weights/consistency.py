"""After loading, the ranks compare their replicated weights: a corrupted file or a different
checkpoint on one node is caught before the first request instead of showing up as garbage output.

Every rank holds the same full copy of each norm weight and grouped top-k router, whatever the tensor-parallel
size, and of each linear layer that does not split (replicated blocks), so their digests must be equal on every rank. A
linear layer whose kernel re-laid its weight out (a packed copy) is compared by the digest of the weight
as loaded, taken just before; the packed copy itself is checked against float64 at start-up
(engine/kernel_setup.py).
"""

from __future__ import annotations

import socket

import torch.distributed as dist
from torch import nn

from shardserve.distributed.control_plane import all_gather_msgpack
from shardserve.distributed.handshake import StartupMismatch
from shardserve.layers.grouped_topk import GroupedTopKRouter
from shardserve.layers.linear import KernelLinear, tensor_digest
from shardserve.layers.norm import RMSNorm


def replicated_digests(model: nn.Module) -> dict[str, str]:
    """name -> sha256 (first 16 hex digits) of each replicated parameter's bytes."""
    digests = {}
    for module_name, module in model.named_modules():
        if isinstance(module, KernelLinear) and module.replicated:
            weight = module.loaded_digest if module.prepared is not None else tensor_digest(module.weight)
            digests[f"{module_name}.weight"] = weight
            if module.bias is not None:
                digests[f"{module_name}.bias"] = tensor_digest(module.bias)
        if not isinstance(module, (RMSNorm, GroupedTopKRouter)):
            continue
        for name, param in module.named_parameters(recurse=False):
            digests[f"{module_name}.{name}"] = tensor_digest(param)
    return digests


def verify_replicated_weights(model: nn.Module, group: dist.ProcessGroup, rank: int, world_size: int,
                              stage_size: int | None = None) -> int:
    """Compare the replicated weights' digests across the group (a collective: every rank calls it). With
    `stage_size` (ranks per pipeline stage, which hold different layers), each rank is compared with the first
    rank of its stage only; every rank still takes part, so every rank sees every stage's verdict. Returns how many
    tensors this rank's stage compared; raises StartupMismatch on every rank if any differ."""
    stage_size = stage_size or world_size
    mine = [rank, socket.gethostname(), replicated_digests(model)]
    gathered = all_gather_msgpack(mine, group, world_size)
    problems = []
    for first in range(0, world_size, stage_size):
        reference_rank, reference_host, reference = gathered[first]
        for other_rank, host, digests in gathered[first + 1:first + stage_size]:
            differing = sorted(n for n in reference.keys() | digests.keys() if reference.get(n) != digests.get(n))
            if differing:
                shown = ", ".join(differing[:3]) + (f" and {len(differing) - 3} more" if len(differing) > 3 else "")
                problems.append(f"rank {other_rank} ({host}) differs from rank {reference_rank} ({reference_host}) "
                                f"in {len(differing)} of {len(reference)} tensors: {shown}")
    if problems:
        raise StartupMismatch("the replicated weights are not the same on every rank after loading (a corrupted "
                              "or different checkpoint?):\n  " + "\n  ".join(problems))
    return len(gathered[rank - rank % stage_size][2])
