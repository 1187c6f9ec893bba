"""All-reduce through shared memory, for CPU ranks on one host.

Gloo sends even a 1 KiB all-reduce through TCP loopback, at about 1 ms on a small host, and a decode
step sends two per layer, so a CPU model split over ranks spent most of each step waiting on gloo. Ranks
on one host can instead meet in one shared mapping: each copies its tensor into its own slot, publishes
a sequence number, waits for every rank's number, and sums the slots itself, all ranks in the same
order, so every rank gets the same bits.

Layout of the mapping (a file in /dev/shm, unlinked as soon as every rank has mapped it):
- a 64-byte header: the file's random name, by which each rank checks it mapped the first rank's file;
- one 64-byte line per rank holding the sequence number it last published and its process id (int64s,
  written only by that rank; a line each, so ranks do not write the same cache line). A rank waiting for
  a peer that has exited fails at once, as gloo does when a peer's socket closes;
- two sets of `world_size` data slots of `max_bytes` each. Call n uses set n % 2: a rank that starts call
  n has seen every rank publish n - 1, so every rank has finished reading the set of call n - 2.

Ordering: a rank stores its data, then its sequence number; a reader loads the numbers, then the data.
x86-64 keeps stores in order with stores and loads with loads for ordinary (cached) stores, which is all
this relies on; copies of up to `max_bytes` (well under the sizes where memcpy switches to non-temporal
stores) stay ordinary. Other architectures use gloo.
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from shardserve.distributed.all_reduce_method import AllReduceMethod

SHM = "shm"
# Larger messages (prefill) are few per step and gloo's ring moves them well enough.
MAX_BYTES = 512 * 1024
LINE = 64
SPIN_BEFORE_YIELD = 64  # busy checks before giving the core away: ranks may outnumber cores
TIMEOUT_S = 600.0  # a peer that stopped arriving: the same bound as the process group's collectives


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmAllReduce(AllReduceMethod):
    name = SHM

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, max_bytes: int = MAX_BYTES,
                 timeout_s: float = TIMEOUT_S) -> None:
        """Collective: every rank of `group` constructs it together. Raises where the ranks cannot share
        memory (another host, no /dev/shm); the caller then agrees with the others to do without."""
        self.rank, self.world_size, self.max_bytes, self.timeout_s = rank, world_size, max_bytes, timeout_s
        self.sequence = 0
        path, magic = _agree_on_path(group, rank)
        size = LINE + world_size * LINE + 2 * world_size * max_bytes
        error: Exception | None = None
        if rank == 0:
            try:
                with open(path, "wb") as f:
                    f.write(magic)  # the rest is zero-filled: every published number starts at 0
                    f.truncate(size)
            except OSError as e:  # /dev/shm full, say: leave no half-made file for the others to map
                error = e
                _remove(path)
        dist.barrier(group=group)
        if error is None:
            try:
                if not os.path.exists(path):  # from_file would create a private one: another host
                    raise FileNotFoundError(f"{path} is not on this host")
                self.buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                if bytes(self.buffer[: len(magic)].tolist()) != magic:
                    raise RuntimeError(f"{path} does not hold the first rank's mapping")
                lines = self.buffer.numpy()[LINE: LINE + world_size * LINE].view(np.int64)
                self.published = lines[:: LINE // 8]
                self.pids = lines[1:: LINE // 8]
                self.pids[rank] = os.getpid()
            except (OSError, RuntimeError) as e:
                error = e
        # Every rank has mapped the file and written its process id, or failed (each rank makes the same
        # collective calls either way): the name can go.
        dist.barrier(group=group)
        if rank == 0:
            _remove(path)
        if error is not None:
            raise error

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def _slot(self, parity: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = LINE + self.world_size * LINE + (parity * self.world_size + rank) * self.max_bytes
        return self.buffer[start:start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.sequence += 1
        parity = self.sequence % 2
        self._slot(parity, self.rank, x).copy_(x)
        self.published[self.rank] = self.sequence
        self._wait_for_all()
        # Every rank sums the slots in rank order, in float32, so all ranks hold the same result.
        total = self._slot(parity, 0, x).to(torch.float32, copy=True)
        for r in range(1, self.world_size):
            total += self._slot(parity, r, x)
        x.copy_(total)
        return x

    def _wait_for_all(self) -> None:
        spins = 0
        deadline = None
        while (self.published < self.sequence).any():
            spins += 1
            if spins <= SPIN_BEFORE_YIELD:
                continue
            os.sched_yield()
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif spins % 1024 == 0:
                self._check_peers(deadline)

    def _check_peers(self, deadline: float) -> None:
        """Fail at once if a rank we wait for has exited (gloo would see its socket close), or at the deadline."""
        late = [r for r in range(self.world_size) if self.published[r] < self.sequence]
        for r in late:
            if not _running(int(self.pids[r])):
                raise RuntimeError(f"shared-memory all-reduce {self.sequence}: rank {r} (process {self.pids[r]}) "
                                   f"has exited")
        if late and time.monotonic() > deadline:
            raise RuntimeError(f"shared-memory all-reduce {self.sequence}: rank(s) {late} did not arrive within "
                               f"{self.timeout_s:.0f} s")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _running(pid: int) -> bool:
    """Whether process `pid` still runs: it exists and is no zombie (an exited child not yet reaped by its
    parent, as a rank is until the launcher waits for it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _agree_on_path(group: dist.ProcessGroup | None, rank: int) -> tuple[str, bytes]:
    """A fresh /dev/shm path chosen by the group's first rank and broadcast to the others, and the bytes
    (its random part) the first rank writes at the start of the file, by which the others know they
    mapped the same memory."""
    name = torch.zeros(32, dtype=torch.uint8)
    if rank == 0:
        name.copy_(torch.frombuffer(bytearray(uuid.uuid4().hex.encode()), dtype=torch.uint8))
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(name, src=src, group=group)
    magic = bytes(name.tolist())
    return f"/dev/shm/shardserve-all-reduce-{magic.decode()}", magic
