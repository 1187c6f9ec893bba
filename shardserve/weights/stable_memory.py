"""Device memory at fixed virtual addresses whose physical backing can be given back and re-created.

CUDA graphs bake in the addresses of every tensor they read: the weights and the KV cache. Sleeping by
freeing those tensors and waking by allocating new ones would move them, and every graph would have to
be captured again (seconds for a few dozen batch sizes). An arena reserves a virtual address range once
with the driver's virtual memory API (cuMemAddressReserve) and maps physical memory into it
(cuMemCreate, cuMemMap). Sleep unmaps and releases the physical memory, which goes back to the driver for
other processes; wake creates new physical memory and maps it at the same addresses, so tensors viewing
the arena, and the graphs that read them, stay valid. Contents do not survive a release: the caller
copies what it needs to keep.

Invariant: nothing may read or write the arena while it is released (the engine sleeps only when no
request is in flight, and synchronizes the device before releasing).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch
from torch import nn

from shardserve import envs
from shardserve.kernels.cuda_driver import check, device_bytes, driver, make_context_current

logger = logging.getLogger(__name__)

ALIGNMENT = 256  # bytes between tensors carved out of an arena (what the caching allocator guarantees)

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def enabled(device: torch.device) -> bool:
    """Arenas are used where available unless SHARDSERVE_STABLE_MEMORY=0 (then sleep frees tensors and wake
    captures the CUDA graphs again)."""
    return envs.STABLE_MEMORY.get() and available(device)


def available(device: torch.device) -> bool:
    """Whether arenas can be made on `device` (a CUDA device with the driver's virtual memory API)."""
    if device.type != "cuda" or driver() is None:
        return False
    try:
        _granularity(device.index if device.index is not None else torch.cuda.current_device())
    except RuntimeError as e:
        logger.info("address-stable device memory unavailable: %s", e)
        return False
    return True


def _prop(ordinal: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    return prop


@functools.cache
def _granularity(ordinal: int) -> int:
    make_context_current(ordinal)
    size = ctypes.c_size_t()
    prop = _prop(ordinal)
    check(driver().cuMemGetAllocationGranularity(ctypes.byref(size), ctypes.byref(prop),
                                                   _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
           "cuMemGetAllocationGranularity")
    return size.value


class StableArena:
    """`nbytes` (rounded up to the driver's granularity) of device memory at a fixed address.

    The physical memory comes in chunks of CHUNK_BYTES, so `map_and_fill` can copy one chunk while the
    driver maps the next.
    """

    CHUNK_BYTES = 1 << 30

    def __init__(self, nbytes: int, device: torch.device, mapped: bool = True) -> None:
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.ordinal)
        gran = _granularity(self.ordinal)
        self.nbytes = max(gran, -(-nbytes // gran) * gran)
        chunk = max(gran, self.CHUNK_BYTES // gran * gran)
        self.chunks = [(start, min(chunk, self.nbytes - start)) for start in range(0, self.nbytes, chunk)]
        make_context_current(self.ordinal)
        address = ctypes.c_uint64()
        check(driver().cuMemAddressReserve(ctypes.byref(address), ctypes.c_size_t(self.nbytes),
                                             ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)),
               "cuMemAddressReserve")
        self.address = address.value
        self._handles: list[int] = []  # one per mapped chunk, in order: chunks map front to back
        if mapped:
            self.map()
        self.bytes = device_bytes(self.address, self.nbytes, self.device)

    @property
    def mapped(self) -> bool:
        """Whether the whole range is backed by physical memory."""
        return len(self._handles) == len(self.chunks)

    def map(self) -> None:
        """Back the range with new physical memory (contents undefined)."""
        self.map_and_fill(None)

    def map_and_fill(self, host: torch.Tensor | None) -> None:
        """Map the range chunk by chunk; with `host` (pinned uint8, the bytes to restore from the start of
        the arena), queue each chunk's copy as soon as that chunk is mapped, so the driver maps the next
        chunk while the previous one copies. The copies are asynchronous on the current stream."""
        if self.mapped:
            return
        make_context_current(self.ordinal)
        try:
            for index, (start, size) in enumerate(self.chunks):
                if index == len(self._handles):  # chunks already mapped (map_through) keep their contents
                    self._map_chunk(start, size)
                if host is not None and start < host.numel():
                    end = min(start + size, host.numel())
                    self.bytes[start:end].copy_(host[start:end], non_blocking=True)
        except RuntimeError:
            self.release()
            raise

    def map_through(self, end: int) -> None:
        """Back the range from its start through byte `end`: an arena filled front to back needs physical
        memory only as far as it has been filled."""
        make_context_current(self.ordinal)
        try:
            while not self.mapped and self.chunks[len(self._handles)][0] < end:
                self._map_chunk(*self.chunks[len(self._handles)])
        except RuntimeError:
            self.release()
            raise

    def _map_chunk(self, start: int, size: int) -> None:
        drv = driver()
        handle = ctypes.c_uint64()
        prop = _prop(self.ordinal)
        check(drv.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                               ctypes.c_uint64(0)), "cuMemCreate")
        address = ctypes.c_uint64(self.address + start)
        result = drv.cuMemMap(address, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
        if result != 0:
            drv.cuMemRelease(handle)
            check(result, "cuMemMap")
        self._handles.append(handle.value)  # mapped: release() now undoes it
        access = _AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, self.ordinal),
                             _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        check(drv.cuMemSetAccess(address, ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)),
               "cuMemSetAccess")

    def release(self) -> None:
        """Give the physical memory back to the driver; the addresses stay reserved for `map`."""
        if not self._handles:
            return
        torch.cuda.synchronize(self.device)  # no kernel or copy may still be using the memory
        drv = driver()
        make_context_current(self.ordinal)
        for (start, size), handle in zip(self.chunks, self._handles):
            check(drv.cuMemUnmap(ctypes.c_uint64(self.address + start), ctypes.c_size_t(size)), "cuMemUnmap")
            check(drv.cuMemRelease(ctypes.c_uint64(handle)), "cuMemRelease")
        self._handles = []

    def close(self) -> None:
        if self.address is None or driver() is None:
            return
        try:
            self.release()
            check(driver().cuMemAddressFree(ctypes.c_uint64(self.address), ctypes.c_size_t(self.nbytes)),
                   "cuMemAddressFree")
        except RuntimeError as e:  # at interpreter exit the context may already be gone
            logger.debug("arena close: %s", e)
        self.address = None

    def __del__(self) -> None:
        self.close()

    def carve(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of the arena shaped like `tensors`, laid out in order (see `arena_bytes`)."""
        views, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            views.append(self.bytes[offset:offset + n].view(t.dtype).view(t.shape))
            offset += -(-n // ALIGNMENT) * ALIGNMENT
        return views


def arena_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(-(-t.numel() * t.element_size() // ALIGNMENT) * ALIGNMENT for t in tensors)


def move_model_into_arena(model: nn.Module, device: torch.device) -> StableArena:
    """Re-home every parameter of `model` into one arena, freeing the old device memory as it goes.

    model.parameters() yields a tied Parameter (the embedding and the LM head) once, so it moves once and both
    holders see the new view. Two distinct Parameters sharing memory cannot be moved (they would be parted),
    nor can linear layers' prepared kernel weights (on CUDA there are none: F.linear reads the weight).
    Buffers stay where they are: they are computed at construction (RoPE tables, head indices), not loaded,
    so a level-2 sleep could not restore them, and they are small.
    """
    if any(getattr(module, "prepared", None) is not None for module in model.modules()):
        raise RuntimeError("prepared linear weights cannot live in an arena")
    params = [p for p in model.parameters() if p.numel()]
    if len({p.untyped_storage().data_ptr() for p in params}) != len(params):
        raise RuntimeError("two parameters share memory; cannot move them into an arena")
    # The arena is backed chunk by chunk as it fills, and the old memory handed back every GiB, so the move
    # needs the weights plus about two GiB, never twice the weights.
    arena = StableArena(arena_bytes(params), device, mapped=False)
    moved = 0
    for param, new in zip(params, arena.carve(params)):
        arena.map_through(new.data_ptr() - arena.address + new.numel() * new.element_size())
        new.copy_(param.data)
        moved += new.numel() * new.element_size()
        param.data = new  # drops the last reference to the old memory
        if moved > 2**30:
            torch.cuda.synchronize(arena.device)
            torch.cuda.empty_cache()
            moved = 0
    arena.map()  # the rounding past the last parameter
    torch.cuda.synchronize(arena.device)
    torch.cuda.empty_cache()
    return arena


def kv_cache_in_arena(num_layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device, beside: list[torch.Tensor] = (), planes: int = 2
                      ) -> tuple[StableArena, torch.Tensor, list[torch.Tensor]]:
    """An arena holding the whole KV cache and, after it, tensors shaped like `beside` (meta tensors: a hybrid
    model's recurrent-state pools); returns it, the [layers, planes, slots, kv_heads, head_dim] view (planes 2: keys
    and values; config.CacheLayout) and those views."""
    shape = (num_layers, planes, slots, kv_heads, head_dim)
    tensors = [torch.empty(shape, dtype=dtype, device="meta"), *beside]
    arena = StableArena(arena_bytes(tensors), device)
    kv, *others = arena.carve(tensors)
    return arena, kv, others
