"""After loading, the ranks compare their replicated weights: a corrupted file or a different
checkpoint on one node is caught before the first request instead of showing up as garbage output.

Every rank holds the same full copy of each norm weight, whatever the tensor-parallel size, so their
digests must be equal on every rank.
"""

from __future__ import annotations

import hashlib
import socket

import torch
import torch.distributed as dist
from torch import nn

from shardserve.distributed.control_plane import all_gather_msgpack
from shardserve.distributed.handshake import StartupMismatch
from shardserve.layers.norm import RMSNorm


def replicated_digests(model: nn.Module) -> dict[str, str]:
    """name -> sha256 (first 16 hex digits) of each replicated parameter's bytes."""
    digests = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, RMSNorm):
            continue
        for name, param in module.named_parameters(recurse=False):
            data = param.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
            digests[f"{module_name}.{name}"] = hashlib.sha256(data).hexdigest()[:16]
    return digests


def verify_replicated_weights(model: nn.Module, group: dist.ProcessGroup, rank: int, world_size: int) -> int:
    """Compare the replicated weights' digests across the group (a collective: every rank calls it).
    Returns how many tensors were compared; raises StartupMismatch on every rank if any differ."""
    mine = [rank, socket.gethostname(), replicated_digests(model)]
    gathered = all_gather_msgpack(mine, group, world_size)
    reference_rank, reference_host, reference = gathered[0]
    problems = []
    for other_rank, host, digests in gathered[1:]:
        differing = sorted(n for n in reference.keys() | digests.keys() if reference.get(n) != digests.get(n))
        if differing:
            shown = ", ".join(differing[:3]) + (f" and {len(differing) - 3} more" if len(differing) > 3 else "")
            problems.append(f"rank {other_rank} ({host}) differs from rank {reference_rank} ({reference_host}) "
                            f"in {len(differing)} of {len(reference)} tensors: {shown}")
    if problems:
        raise StartupMismatch("the replicated weights are not the same on every rank after loading (a corrupted "
                              "or different checkpoint?):\n  " + "\n  ".join(problems))
    return len(reference)
