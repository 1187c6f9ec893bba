"""Device memory that every rank on one host can read and write: one allocation per rank, mapped into
the others through CUDA IPC handles (the driver API, through ctypes).

The all-reduce kernels of kernels/triton/all_reduce.py write into peers' memory and poll flags in their
own; this module only allocates, exchanges handles and maps. Unlike torch's symmetric memory, it keeps no
process-wide state: the handles travel on the control group of the engine that asks, so a second engine
in the same process (a restart, a second `LLM`) sets up exactly like the first.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from shardserve.kernels import cuda_driver

logger = logging.getLogger(__name__)

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class PeerMemory:
    """`nbytes` of zeroed device memory on this rank and the same on every other rank of `group`, all
    addressable from this rank's GPU. `addresses[r]` is rank r's allocation as seen from here (this rank's
    own at [rank]). A collective over the control group: every rank constructs it, in the same order."""

    def __init__(self, nbytes: int, device: torch.device, group, rank: int, world_size: int) -> None:
        from shardserve.distributed.control_plane import all_gather_msgpack

        drv = cuda_driver.driver()
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.nbytes = nbytes
        self._opened: list[int] = []
        self.local = None
        cuda_driver.make_context_current(self.ordinal)
        error = None
        handle = _IpcHandle()
        try:
            local = ctypes.c_uint64()
            cuda_driver.check(drv.cuMemAlloc_v2(ctypes.byref(local), ctypes.c_size_t(nbytes)), "cuMemAlloc")
            self.local = local.value
            cuda_driver.device_bytes(self.local, nbytes, device).zero_()
            torch.cuda.synchronize(device)
            cuda_driver.check(drv.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(self.local)),
                                 "cuIpcGetMemHandle")
        except RuntimeError as e:
            error = str(e)
        # Every rank takes part in the exchange even after a local failure, so none waits for a missing one.
        shared = all_gather_msgpack([error, bytes(handle)], group, world_size)
        failed = [(r, e) for r, (e, _) in enumerate(shared) if e]
        if failed:
            self.close()
            raise RuntimeError("peer memory unavailable: " + "; ".join(f"rank {r}: {e}" for r, e in failed))
        self.addresses: list[int] = []
        try:
            for r, (_, raw) in enumerate(shared):
                if r == rank:
                    self.addresses.append(self.local)
                    continue
                peer = _IpcHandle.from_buffer_copy(bytes(raw))
                mapped = ctypes.c_uint64()
                cuda_driver.check(drv.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), peer,
                                                               ctypes.c_uint(_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)),
                                     f"cuIpcOpenMemHandle (rank {r}'s memory)")
                self._opened.append(mapped.value)
                self.addresses.append(mapped.value)
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        """Unmap the peers' memory and free this rank's. The caller makes sure no kernel still uses it."""
        drv = cuda_driver.driver()
        if drv is None:
            return
        try:
            cuda_driver.make_context_current(self.ordinal)
            for address in self._opened:
                drv.cuIpcCloseMemHandle(ctypes.c_uint64(address))
            if self.local is not None:
                drv.cuMemFree_v2(ctypes.c_uint64(self.local))
        except RuntimeError as e:  # at interpreter exit the context may already be gone
            logger.debug("peer memory close: %s", e)
        self._opened, self.local = [], None

    def __del__(self) -> None:
        self.close()
