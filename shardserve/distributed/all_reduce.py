"""All-reduce methods for the tensor-parallel data plane, and the start-up measurement that picks one.

Which method is fastest depends on the hardware: on NVLink hosts torch symmetric memory (one-shot
or two-shot kernels reading peers' buffers directly) wins for small messages, NCCL for large ones;
on some NICs NCCL run eagerly between CUDA-graph pieces beats NCCL captured inside the graph. So
each method is timed on the actual group at start-up, per message size, and the choice is logged.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Forces one method for every message size (tests, diagnosis): a name from METHOD_NAMES.
FORCE_ENV = "SHARDSERVE_ALL_REDUCE"
NCCL = "nccl"  # NCCL captured inside the CUDA graph (or called eagerly outside graphs)
NCCL_EAGER_PIECES = "nccl-eager"  # NCCL run eagerly between graph pieces: graphs are split at each call
SYMM_ONE_SHOT = "symm-one-shot"
SYMM_TWO_SHOT = "symm-two-shot"
METHOD_NAMES = (NCCL, NCCL_EAGER_PIECES, SYMM_ONE_SHOT, SYMM_TWO_SHOT)
# CPU ranks: the process group's own all-reduce (gloo), or shared memory between ranks on one host.
GLOO = "gloo"
SHM = "shm"
CPU_METHOD_NAMES = (GLOO, SHM)

# Symmetric-memory kernels pay off for small messages only; larger ones go to NCCL.
SYMM_MAX_BYTES = 512 * 1024
# A graph split at every all-reduce costs extra launches: eager NCCL must beat in-graph methods by this much.
SPLIT_MARGIN_US = 5.0


class AllReduceMethod:
    name: str = ""

    def supports(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group; returns the result (x itself, reduced in place, or a new tensor)."""
        raise NotImplementedError


class NcclAllReduce(AllReduceMethod):
    """The process group's own all-reduce: NCCL on GPUs, gloo on CPUs (named so there)."""

    name = NCCL

    def __init__(self, group: dist.ProcessGroup, name: str = NCCL) -> None:
        self.group = group
        self.name = name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x


class SymmetricMemoryAllReduce(AllReduceMethod):
    """One-shot or two-shot all-reduce through torch symmetric memory (no NVLink multicast).

    The input is copied into a slot of a symmetric buffer that every peer can read. Invariant: two
    consecutive all-reduces never use the same slot. The one-shot kernel synchronises only at its
    start, so a rank that runs ahead would otherwise overwrite a slot a peer is still reading. Calls
    captured in a CUDA graph take slots 0, 1, 2, ... from `graph_slots` (reset at each capture, with
    more slots than calls in one forward, so a graph's last slot is never its first), and eager calls
    alternate between two slots of their own: graph and eager calls never share a slot.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, kind: str,
                 graph_slots: int, slot_bytes: int = SYMM_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.name = kind
        self.kind = kind
        self.group_name = group.group_name
        self.slot_numel = slot_bytes // dtype.itemsize
        self.dtype = dtype
        self.num_graph_slots = graph_slots
        self.buffer = symm_mem.empty((graph_slots + 2) * self.slot_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self._graph_next = 0
        self._eager_next = 0
        self._capturing = False

    def begin_capture(self) -> None:
        self._capturing, self._graph_next = True, 0

    def end_capture(self) -> None:
        self._capturing = False

    def supports(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.slot_numel

    def _slot(self) -> int:
        if self._capturing:
            if self._graph_next >= self.num_graph_slots:
                raise RuntimeError(f"a captured forward made more than {self.num_graph_slots} all-reduces")
            slot, self._graph_next = self._graph_next, self._graph_next + 1
            return slot
        slot, self._eager_next = self.num_graph_slots + self._eager_next, 1 - self._eager_next
        return slot

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        start = self._slot() * self.slot_numel
        view = self.buffer[start:start + x.numel()]
        view.copy_(x.view(-1))
        out = x.view(-1)
        if self.kind == SYMM_ONE_SHOT:
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", self.group_name, out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", self.group_name)
            out.copy_(view)
        return x


@dataclass
class SizeTable:
    """Message size -> method: the first entry whose max_bytes covers the message (None = unbounded)."""

    entries: list[tuple[int | None, AllReduceMethod]] = field(default_factory=list)

    def pick(self, x: torch.Tensor) -> AllReduceMethod:
        nbytes = x.numel() * x.element_size()
        for max_bytes, method in self.entries:
            if (max_bytes is None or nbytes <= max_bytes) and method.supports(x):
                return method
        return self.entries[-1][1]

    def describe(self) -> str:
        parts = []
        for max_bytes, method in self.entries:
            parts.append(method.name + ("" if max_bytes is None else f" <= {_human(max_bytes)}"))
        return ", ".join(parts) + ("" if self.entries and self.entries[-1][0] is None else ", nccl above")


@dataclass
class AllReduceChoice:
    eager: SizeTable  # outside CUDA graphs (prefill, mixed steps)
    graph: SizeTable  # inside decode CUDA graphs
    split_sizes: frozenset[int]  # decode graphs with messages of these sizes (bytes) are split at each all-reduce
    timings_us: dict[str, dict[int, float]]  # "<method>/<graph|eager>" -> message bytes -> microseconds

    def split_graph(self, nbytes: int) -> bool:
        return nbytes in self.split_sizes

    def describe(self) -> str:
        graph = self.graph.describe()
        if self.split_sizes:
            split = ", ".join(_human(n) for n in sorted(self.split_sizes))
            graph = f"{graph} (split graphs, nccl eager between pieces, at {split})"
        return f"in graphs: {graph}; eager: {self.eager.describe()}"


def _human(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes < 1 << 20 else f"{nbytes / 2**20:g} MiB"


def _time_us(fn: Callable[[], object], iters: int, synchronize: Callable[[], None] = torch.cuda.synchronize
             ) -> float:
    """Microseconds per call of fn, after a warm-up; `synchronize` waits for the device (GPUs)."""
    for _ in range(5):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize()
    return (time.perf_counter() - start) * 1e6 / iters


def _time_in_graph_us(method: AllReduceMethod, x: torch.Tensor, calls: int = 32, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        method(x)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    capture = getattr(method, "begin_capture", None)
    if capture:
        capture()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                method(x)
    finally:
        if capture:
            method.end_capture()
    return _time_us(graph.replay, replays) / calls


def _agree(value: float, group: dist.ProcessGroup, device: torch.device) -> float:
    """Every rank must choose the same method: decide on the slowest rank's figure."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def build_methods(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, graph_slots: int
                  ) -> list[AllReduceMethod]:
    methods: list[AllReduceMethod] = [NcclAllReduce(group)]
    for kind in (SYMM_ONE_SHOT, SYMM_TWO_SHOT):
        try:
            method = SymmetricMemoryAllReduce(group, device, dtype, kind, graph_slots)
        except Exception as e:  # no symmetric memory on this platform or torch build
            logger.info("all-reduce: %s unavailable (%s)", kind, str(e).splitlines()[0][:200] if str(e) else e)
            method = None
        # Every rank must measure the same methods in the same order, or their collectives would
        # pair up wrongly: keep a method only where all ranks have it.
        if _agree(0.0 if method is not None else 1.0, group, device) == 0.0 and method is not None:
            methods.append(method)
    return methods


def calibrate(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, message_sizes: list[int],
              graph_slots: int) -> AllReduceChoice:
    """Time every method at each message size (bytes) on this group and build the size tables.

    A method that raises or gives a wrong sum is dropped. Every rank runs the same measurements in
    the same order and takes the maximum over ranks, so all ranks pick the same tables.
    """
    methods = build_methods(group, device, dtype, graph_slots)
    forced = os.environ.get(FORCE_ENV)
    if forced and forced not in METHOD_NAMES:
        raise ValueError(f"{FORCE_ENV}={forced!r} is not an all-reduce method: use one of {', '.join(METHOD_NAMES)}")
    timings: dict[str, dict[int, float]] = {}
    world = dist.get_world_size(group)
    for nbytes in sorted(set(message_sizes)):
        x = torch.full((nbytes // dtype.itemsize,), 1.0, dtype=dtype, device=device)
        for method in methods:
            if not method.supports(x):
                continue
            for mode in ("eager", "graph"):
                key = f"{NCCL_EAGER_PIECES if (method.name == NCCL and mode == 'eager') else method.name}/{mode}"
                try:
                    x.fill_(1.0)
                    result = method(x)
                    ok = bool((result == world).all())
                    us = (_time_in_graph_us(method, x) if mode == "graph"
                          else _time_us(lambda: method(x), 50))
                except Exception as e:
                    logger.debug("all-reduce %s failed at %d bytes: %s", key, nbytes, e)
                    ok, us = False, float("inf")
                us = _agree(us if ok else float("inf"), group, device)
                timings.setdefault(key, {})[nbytes] = us
    return _choose(methods, timings, sorted(set(message_sizes)), forced)


def _choose(methods: list[AllReduceMethod], timings: dict[str, dict[int, float]], sizes: list[int],
            forced: str | None) -> AllReduceChoice:
    """Per message size: the fastest method in graphs and eagerly, and whether to split graphs instead.

    Splitting is decided per size (so per graph bucket): a graph of that size is captured in pieces
    only where eager NCCL between pieces beats the best in-graph method by more than SPLIT_MARGIN_US,
    the price of the extra graph launches.
    """
    by_name = {m.name: m for m in methods}
    nccl = by_name[NCCL]

    def measured(mode: str, nbytes: int) -> dict[str, float]:
        return {key.split("/")[0]: t[nbytes] for key, t in timings.items()
                if key.endswith("/" + mode) and nbytes in t}

    def best(mode: str, nbytes: int) -> str:
        options = measured(mode, nbytes)
        if mode == "eager":  # outside graphs NCCL is NCCL: its eager timing is filed under the pieces key
            options = {(NCCL if k == NCCL_EAGER_PIECES else k): v for k, v in options.items()}
        if forced:
            return forced if forced in options else NCCL
        return min(options, key=options.get) if options else NCCL

    def split(nbytes: int) -> bool:
        if forced:
            return forced == NCCL_EAGER_PIECES
        in_graph = measured("graph", nbytes)
        eager = timings.get(f"{NCCL_EAGER_PIECES}/eager", {}).get(nbytes, float("inf"))
        return bool(in_graph) and eager + SPLIT_MARGIN_US < min(in_graph.values())

    def table(mode: str) -> SizeTable:
        return _size_table({n: by_name.get(best(mode, n), nccl) for n in sizes}, nccl)

    return AllReduceChoice(table("eager"), table("graph"), frozenset(n for n in sizes if split(n)), timings)


def _size_table(chosen: dict[int, AllReduceMethod], fallback: AllReduceMethod) -> SizeTable:
    """The table for the method chosen at each measured size (bytes): one entry per run of sizes with the
    same method, bounded by the run's largest size; `fallback` for everything above."""
    entries: list[tuple[int | None, AllReduceMethod]] = []
    for nbytes in sorted(chosen):
        method = chosen[nbytes]
        if entries and entries[-1][1] is method:
            entries[-1] = (nbytes, method)
        else:
            entries.append((nbytes, method))
    if entries and entries[-1][1] is fallback:
        entries[-1] = (None, fallback)
    else:
        entries.append((None, fallback))
    return SizeTable(entries)


def calibrate_cpu(group: dist.ProcessGroup, rank: int, world_size: int, dtype: torch.dtype,
                  message_sizes: list[int]) -> AllReduceChoice:
    """CPU ranks: time gloo against the shared-memory all-reduce (where every rank can map the same
    memory) at each message size up to the latter's limit, and build the size table; gloo above it.
    Every rank makes the same calls in the same order and decides on the slowest rank's figures."""
    from shardserve.distributed import shm_all_reduce

    cpu = torch.device("cpu")
    gloo = NcclAllReduce(group, name=GLOO)
    methods: list[AllReduceMethod] = [gloo]
    shm = None
    if _agree(0.0 if shm_all_reduce.supported() else 1.0, group, cpu) == 0.0:  # constructing is collective
        try:
            shm = shm_all_reduce.ShmAllReduce(group, rank, world_size)
        except Exception as e:  # another host, or no shared memory
            logger.info("all-reduce: %s unavailable (%s)", SHM, e)
        if _agree(0.0 if shm is not None else 1.0, group, cpu) == 0.0 and shm is not None:
            methods.append(shm)
    forced = os.environ.get(FORCE_ENV)
    if forced and forced not in CPU_METHOD_NAMES:
        raise ValueError(f"{FORCE_ENV}={forced!r} is not an all-reduce method for CPU ranks: use one of "
                         f"{', '.join(CPU_METHOD_NAMES)}")
    # The model's sizes up to the shared-memory limit, and the limit itself where larger ones exist (prefill
    # chunks between the largest decode batch and the limit then take the faster method too).
    sizes = {n for n in message_sizes if n <= shm_all_reduce.MAX_BYTES}
    if max(message_sizes) > shm_all_reduce.MAX_BYTES:
        sizes.add(shm_all_reduce.MAX_BYTES)
    sizes = sorted(sizes)
    timings: dict[str, dict[int, float]] = {}
    chosen: dict[int, AllReduceMethod] = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype)
        best, best_us = gloo, float("inf")
        for method in methods:
            if not method.supports(x):
                continue
            x.fill_(1.0)
            ok = bool((method(x) == world_size).all())
            us = _time_us(lambda: method(x), 20, synchronize=lambda: None) if ok else float("inf")
            us = _agree(us, group, cpu)
            timings.setdefault(f"{method.name}/eager", {})[nbytes] = us
            if (forced == method.name) or (not forced and us < best_us):
                best, best_us = method, us
        chosen[nbytes] = best
    table = _size_table(chosen, gloo)
    return AllReduceChoice(table, table, frozenset(), timings)
