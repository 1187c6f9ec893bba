"""The sampled tokens from rank 0 to the other ranks through peer memory, inside the decode CUDA graphs.

Only rank 0 samples. In overlapped decoding the next step's input tokens are still on rank 0's device when
that step is queued, so every step begins with a broadcast of them. Through NCCL that broadcast runs eagerly
between two graph replays (tens of microseconds at batch 1, during which the other ranks' graphs cannot start);
here it is the first kernel of every decode graph (kernels/triton/broadcast.py): the other ranks launch their
graph early and wait inside it, and the ids cross NVLink in one write each.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from shardserve.distributed.all_reduce import every_rank, first_line
from shardserve import envs

logger = logging.getLogger(__name__)

# "nccl" keeps the sampled tokens on NCCL (eager, between graph replays), for comparison and diagnosis.
MODE_ENV = envs.TOKEN_BROADCAST.name
MODES = envs.TOKEN_BROADCAST.choices


def wanted() -> bool:
    """Whether to set up the peer-memory broadcast (SHARDSERVE_TOKEN_BROADCAST, default "peer")."""
    return envs.TOKEN_BROADCAST.get() == "peer"


class PeerTokenBroadcast:
    """Rank 0's int64 token ids to every rank, for up to `max_rows` ids a call. A collective over the control
    group (gloo) at construction, which carries the peers' memory handles; every rank constructs it in the same
    order. Calls are collective too, and consecutive calls must have a collective between them (the forward
    that uses the tokens all-reduces): see the kernel's module."""

    def __init__(self, control_group, rank: int, world_size: int, device: torch.device, max_rows: int) -> None:
        from shardserve.distributed.ipc_memory import PeerMemory

        self.rank, self.world_size, self.max_rows = rank, world_size, max_rows
        self.memory = PeerMemory(max_rows * 8, device, control_group, rank, world_size)
        self.word_ptrs = torch.tensor(self.memory.addresses, dtype=torch.int64, device=device)
        self.counters = torch.zeros(max_rows, dtype=torch.int32, device=device)

    def supports(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.long and x.is_cuda and x.is_contiguous() and x.numel() <= self.max_rows

    def __call__(self, x: torch.Tensor) -> None:
        from shardserve.kernels.triton.broadcast import broadcast_ids

        broadcast_ids(x, self.word_ptrs, self.counters, self.rank, self.world_size)

    def close(self) -> None:
        self.memory.close()


def build(group: dist.ProcessGroup, control_group, rank: int, world_size: int, device: torch.device,
          max_rows: int) -> PeerTokenBroadcast | None:
    """The peer-memory token broadcast, checked on known ids against what rank 0 sent; None on every rank
    (logged) where any rank could not set it up or received a wrong id. Collective over both groups."""
    method, problem = None, ""
    try:
        method = PeerTokenBroadcast(control_group, rank, world_size, device, max_rows)
    except Exception as e:  # no CUDA IPC between these processes, no Triton
        problem = f"unavailable ({first_line(e)})"
    if every_rank(method is not None, group, device) and method is not None:
        from shardserve.kernels.triton.broadcast import MAX_TOKEN_ID

        # Ids across the whole range, the largest included; the other ranks start from values that differ.
        sent = (torch.arange(max_rows, device=device) * 7919) % (MAX_TOKEN_ID + 1)
        sent[-1] = MAX_TOKEN_ID
        x = sent.clone() if rank == 0 else torch.full_like(sent, -1)
        try:
            method(x)
            wrong = int((x != sent).sum())
        except Exception as e:  # noqa: BLE001 - a failing kernel falls back like a wrong one
            wrong, problem = max_rows, f"{type(e).__name__}: {e}"
        if not every_rank(wrong == 0, group, device):
            problem = problem or f"{wrong} of {max_rows} ids wrong on rank {rank} in the start-up check"
            method.close()
            method = None
    elif method is not None:
        method.close()
        method = None
    if method is None and rank == 0:
        logger.info("token broadcast through peer memory not used (%s): NCCL broadcasts the sampled tokens "
                    "between graph replays", problem or "another rank could not set it up")
    return method
