"""All-reduce methods for the tensor-parallel data plane, and the start-up measurement that picks one.

Which method is fastest depends on the hardware: on NVLink hosts torch symmetric memory (one-shot
or two-shot kernels reading peers' buffers directly) wins for small messages, NCCL for large ones;
on some NICs NCCL run eagerly between CUDA-graph pieces beats NCCL captured inside the graph. So
each method is timed on the actual group at start-up, per message size, and the choice is logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from shardserve import envs
from shardserve.distributed.all_reduce_method import AllReduceMethod

logger = logging.getLogger(__name__)

# Forces one method for every message size (tests, diagnosis): a name from METHOD_NAMES.
FORCE_ENV = envs.ALL_REDUCE.name
NCCL = "nccl"  # NCCL captured inside the CUDA graph (or called eagerly outside graphs)
NCCL_EAGER_PIECES = "nccl-eager"  # NCCL run eagerly between graph pieces: graphs are split at each call
SYMM_ONE_SHOT = "symm-one-shot"
SYMM_TWO_SHOT = "symm-two-shot"
IPC_ONE_SHOT = "ipc-one-shot"  # kernels/triton/all_reduce.py over distributed/ipc_memory.py
METHOD_NAMES = (NCCL, NCCL_EAGER_PIECES, SYMM_ONE_SHOT, SYMM_TWO_SHOT, IPC_ONE_SHOT)
# CPU ranks: the process group's own all-reduce (gloo), or shared memory between ranks on one host.
GLOO = "gloo"
SHM = "shm"
CPU_METHOD_NAMES = (GLOO, SHM)

# Symmetric-memory kernels pay off for small messages only; larger ones go to NCCL.
SYMM_MAX_BYTES = 512 * 1024
# The peer-memory one-shot's slots hold the model's messages up to this size (the decode graphs' at up to 512
# sequences of an 8192-wide model); larger ones (prefill chunks) go to NCCL. A rank's area is SLOTS x world slots.
IPC_MAX_SLOT_BYTES = 8 * 2**20
# Whether a row-parallel batch-1 GEMV sums its output over the ranks, adds the residual and applies the next norm in
# its own launch (kernels/triton/gemv_all_reduce.py: "fused"), or leaves that to the all-reduce kernel after it
# ("separate", the default: on two H100s the Llama-3-8B-shaped TP=2 batch-1 graph took 2.968 ms with it and
# 3.015 ms fused; docs/benchmarks-notebook.md).
GEMV_ALL_REDUCE_ENV = envs.GEMV_ALL_REDUCE.name
# torch's symmetric memory numbers its rendezvous with a counter per process that no API exposes or resets:
# ranks whose processes made different numbers of them (rank 0 in a process that already ran an engine, the
# others fresh) wait for each other's keys forever. Counted here, so such ranks skip it instead.
_symm_rendezvous_count = 0
# A graph split at every all-reduce costs extra launches: eager NCCL must beat in-graph methods by this much.
SPLIT_MARGIN_US = 5.0


def gemv_add_on() -> bool:
    """Whether row-parallel batch-1 GEMVs all-reduce in their own launch where the method has that form."""
    return envs.GEMV_ALL_REDUCE.get() == "fused"


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
        global _symm_rendezvous_count
        self.buffer = symm_mem.empty((graph_slots + 2) * self.slot_numel, dtype=dtype, device=device)
        _symm_rendezvous_count += 1
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


class IpcOneShotAllReduce(AllReduceMethod):
    """One-shot all-reduce by a Triton kernel that writes each rank's rows into its peers' memory and polls
    flags in its own (kernels/triton/all_reduce.py), and the same kernel fused with the residual add and
    RMSNorm after it (`add_rms_norm`). Messages of up to `slot_bytes` (peer_slot_bytes: the largest the model
    sends up to IPC_MAX_SLOT_BYTES) of up to MAX_ROWS rows of up to MAX_COLS.

    Slots: two consecutive calls never use the same slot (the kernel's invariant). A captured graph's first
    call takes slot 0 and its later calls alternate between 1 and 2, so a graph's last call never shares a
    slot with the next replay's first, of this graph or another; eager calls alternate between 3 and 4.
    """

    name = IPC_ONE_SHOT
    SLOTS = 5
    MAX_ROWS = 1024
    MAX_COLS = 32768
    # The low-latency form's words: up to LL_ROWS rows of 32 KiB of values (16384 16-bit columns) a message.
    LL_ROWS = 8
    LL_ROW_BYTES = 64 * 1024

    def __init__(self, control_group, rank: int, world_size: int, device: torch.device, dtype: torch.dtype,
                 slot_bytes: int = SYMM_MAX_BYTES) -> None:
        """A collective over `control_group` (gloo), which carries the peers' memory handles."""
        from shardserve.distributed.ipc_memory import PeerMemory

        self.rank, self.world_size, self.dtype = rank, world_size, dtype
        self.slot_numel = slot_bytes // dtype.itemsize
        data_bytes = self.SLOTS * world_size * slot_bytes
        flag_bytes = self.SLOTS * self.MAX_ROWS * world_size * 4
        self.memory = PeerMemory(self.area_bytes(slot_bytes, world_size), device, control_group, rank, world_size)
        addresses = self.memory.addresses
        self.data_ptrs = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([a + data_bytes for a in addresses], dtype=torch.int64, device=device)
        self.ll_ptrs = torch.tensor([a + data_bytes + flag_bytes for a in addresses], dtype=torch.int64,
                                    device=device)
        self.counters = torch.zeros(self.SLOTS * self.MAX_ROWS, dtype=torch.int32, device=device)
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            from shardserve.kernels.triton.arrivals import arrival_counts

            arrival_counts(device, 1)  # made here, eagerly: `gemv_add` needs them, mostly inside graph captures
        self._capturing = False
        self._graph_calls = 0
        self._eager_next = 0
        self.gemv_calls = 0  # calls of `gemv_add`, captured or eager (the tests read it)

    @classmethod
    def area_bytes(cls, slot_bytes: int, world_size: int) -> int:
        """Device memory a rank allocates (and maps from every peer): data slots, flags, low-latency words."""
        return cls.SLOTS * world_size * (slot_bytes + cls.MAX_ROWS * 4 + cls.LL_ROWS * cls.LL_ROW_BYTES)

    def begin_capture(self) -> None:
        self._capturing, self._graph_calls = True, 0

    def end_capture(self) -> None:
        self._capturing = False

    def supports(self, x: torch.Tensor) -> bool:
        rows, cols = _rows_cols(x)
        return (x.dtype == self.dtype and x.is_cuda and x.is_contiguous() and x.numel() <= self.slot_numel
                and rows <= self.MAX_ROWS and cols <= self.MAX_COLS)

    def _slot(self) -> int:
        if self._capturing:
            calls, self._graph_calls = self._graph_calls, self._graph_calls + 1
            return 0 if calls == 0 else 1 + (calls - 1) % 2
        slot, self._eager_next = 3 + self._eager_next, 1 - self._eager_next
        return slot

    def _launch(self, x: torch.Tensor, residual, weight, eps: float) -> torch.Tensor:
        from shardserve.kernels.triton.all_reduce import one_shot

        rows, cols = _rows_cols(x)
        one_shot(x.view(rows, cols), residual.view(rows, cols) if residual is not None else None, weight, eps,
                 self.data_ptrs, self.flag_ptrs, self.ll_ptrs, self.counters, self._slot(), self.slot_numel,
                 self.LL_ROWS, self.LL_ROW_BYTES, self.MAX_ROWS, self.rank, self.world_size)
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.supports(x):  # a message larger than a slot would overrun it
            raise ValueError(f"{self.name} cannot reduce a {tuple(x.shape)} {x.dtype} message")
        return self._launch(x, None, None, 0.0)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(s) * weight, s) with s = sum of x over the ranks + residual, in one launch; x and residual
        are overwritten with them. None where the inputs do not fit this kernel."""
        if residual.shape != x.shape or not residual.is_contiguous() \
                or residual.dtype != x.dtype:
            return None
        if weight.dtype != x.dtype or not self.supports(x):
            return None
        self._launch(x, residual, weight, eps)
        return x, residual

    def takes_gemv(self, residual: torch.Tensor, block_n: int) -> bool:
        """Whether `gemv_add` can add into this residual, computed in row blocks of block_n."""
        from shardserve.kernels.triton.arrivals import arrival_counts
        from shardserve.kernels.triton.gemv_all_reduce import fits

        return (residual.dtype == self.dtype and residual.is_cuda and residual.dim() == 2
                and residual.shape[0] == 1 and residual.is_contiguous()
                and fits(residual.shape[1], self.dtype, block_n, self.LL_ROW_BYTES)
                and arrival_counts(residual.device, 1) is not None)

    def gemv_add(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float, swiglu: bool, config: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(s) * norm_weight, s) with s = residual + the sum over the ranks of x @ weight^T (of
        silu(gate) * up for x = [gate | up] with `swiglu`), written over residual: the GEMV, this all-reduce, the
        add and the norm in one launch (kernels/triton/gemv_all_reduce.py), as a call of this method (it takes a
        slot). Only where takes_gemv(residual, config[0])."""
        from shardserve.kernels.triton.gemv_all_reduce import gemv_all_reduce

        self.gemv_calls += 1
        return gemv_all_reduce(x, weight, residual, norm_weight, eps, swiglu, config, self.ll_ptrs, self.counters,
                               self._slot(), self.LL_ROWS * self.LL_ROW_BYTES // 8, self.MAX_ROWS, self.rank,
                               self.world_size)

    def close(self) -> None:
        self.memory.close()


def peer_slot_bytes(message_sizes: Iterable[int], row_bytes: int | None = None) -> int:
    """The peer-memory all-reduce's slot for a model that sends messages of these sizes (bytes) in rows of
    `row_bytes`: the largest it can carry (up to IPC_MAX_SLOT_BYTES, and MAX_ROWS rows), at least SYMM_MAX_BYTES."""
    max_rows = IpcOneShotAllReduce.MAX_ROWS
    return max([SYMM_MAX_BYTES, *(n for n in message_sizes
                                  if n <= IPC_MAX_SLOT_BYTES and (not row_bytes or n <= max_rows * row_bytes))])


def message_shape(nbytes: int, dtype: torch.dtype, row_bytes: int | None) -> tuple[int, ...]:
    """A message of `nbytes` as the model sends it, [tokens, hidden] with rows of `row_bytes`, or flat
    (without row_bytes, or when the rows do not divide it)."""
    if row_bytes and nbytes % row_bytes == 0:
        return nbytes // row_bytes, row_bytes // dtype.itemsize
    return (max(1, nbytes // dtype.itemsize),)


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    cols = x.shape[-1] if x.dim() else 1
    return (x.numel() // cols if cols else 0), cols


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

    def methods(self) -> list[AllReduceMethod]:
        """The chosen methods, each once (one may stand in both tables)."""
        return list({id(m): m for table in (self.eager, self.graph) for _, m in table.entries}.values())

    def describe(self) -> str:
        graph = self.graph.describe()
        if self.split_sizes:
            split = ", ".join(_human(n) for n in sorted(self.split_sizes))
            graph = f"{graph} (split graphs, nccl eager between pieces, at {split})"
        fused = [m.name for m in self.methods() if hasattr(m, "gemv_add")]
        inside = f"; inside the row-parallel batch-1 GEMVs: {', '.join(fused)}" if fused and gemv_add_on() else ""
        return f"in graphs: {graph}; eager: {self.eager.describe()}{inside}"


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


def _time_in_graph_us(method: Callable[[torch.Tensor], object], x: torch.Tensor, calls: int = 32,
                      replays: int = 20, owner: object = None) -> float:
    """Microseconds per call of method(x) replayed from a CUDA graph; `owner` (default: method) is the
    all-reduce whose slots the capture uses."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        method(x)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    owner = owner if owner is not None else method
    capture = getattr(owner, "begin_capture", None)
    if capture:
        capture()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                method(x)
    finally:
        if capture:
            owner.end_capture()
    return _time_us(graph.replay, replays) / calls


def _agree(value: float, group: dist.ProcessGroup, device: torch.device) -> float:
    """Every rank must choose the same method: decide on the slowest rank's figure."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def every_rank(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the group (a collective: every rank asks)."""
    return _agree(0.0 if ok else 1.0, group, device) == 0.0


def build_methods(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, graph_slots: int,
                  control_group=None, peer_slot: int = SYMM_MAX_BYTES) -> list[AllReduceMethod]:
    """NCCL, and the peer-memory methods every rank could set up (the one-shot's slots of `peer_slot` bytes).
    Every rank must measure the same methods in the same order, or their collectives would pair up wrongly: a
    method is kept only where all ranks have it."""
    methods: list[AllReduceMethod] = [NcclAllReduce(group)]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if control_group is not None:
        try:
            method = IpcOneShotAllReduce(control_group, rank, world, device, dtype, peer_slot)
        except Exception as e:  # no CUDA IPC between these processes, no Triton
            logger.info("all-reduce: %s unavailable (%s)", IPC_ONE_SHOT, first_line(e))
            method = None
        if every_rank(method is not None, group, device) and method is not None:
            methods.append(method)
    # torch's symmetric memory only where every rank's process has made as many rendezvous as the others.
    counts_differ = _agree(float(_symm_rendezvous_count), group, device) != -_agree(
        -float(_symm_rendezvous_count), group, device)
    if counts_differ:
        logger.info("all-reduce: torch symmetric memory skipped: the ranks' processes have set it up different "
                    "numbers of times (an engine ran before in one of them), and its rendezvous would never meet")
        return methods
    for kind in (SYMM_ONE_SHOT, SYMM_TWO_SHOT):
        try:
            method = SymmetricMemoryAllReduce(group, device, dtype, kind, graph_slots)
        except Exception as e:  # no symmetric memory on this platform or torch build
            logger.info("all-reduce: %s unavailable (%s)", kind, first_line(e))
            method = None
        if every_rank(method is not None, group, device) and method is not None:
            methods.append(method)
    return methods


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def calibrate(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, message_sizes: list[int],
              graph_slots: int, control_group=None, row_bytes: int | None = None) -> AllReduceChoice:
    """Time every method at each message size (bytes) on this group and build the size tables.

    A method that raises or gives a wrong sum is dropped. Every rank runs the same measurements in
    the same order and takes the maximum over ranks, so all ranks pick the same tables. Messages are shaped
    [tokens, hidden] with rows of `row_bytes` (the model's activations), or flat without it.
    """
    methods = build_methods(group, device, dtype, graph_slots, control_group,
                            peer_slot_bytes(message_sizes, row_bytes))
    forced = envs.ALL_REDUCE.get()
    if forced and forced not in METHOD_NAMES:
        raise ValueError(f"{FORCE_ENV}={forced!r} is not an all-reduce method: use one of {', '.join(METHOD_NAMES)}")
    timings: dict[str, dict[int, float]] = {}
    world = dist.get_world_size(group)
    for nbytes in sorted(set(message_sizes)):
        x = torch.full(message_shape(nbytes, dtype, row_bytes), 1.0, dtype=dtype, device=device)
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
            if isinstance(method, IpcOneShotAllReduce) and x.dim() == 2:  # the fused form, for the record
                residual, weight = torch.zeros_like(x), torch.ones_like(x[0])
                try:
                    us = _time_in_graph_us(lambda t: method.add_rms_norm(t, residual, weight, 1e-5), x, owner=method)
                except Exception as e:
                    logger.debug("all-reduce %s+norm failed at %d bytes: %s", method.name, nbytes, e)
                    us = float("inf")
                timings.setdefault(f"{method.name}+norm/graph", {})[nbytes] = _agree(us, group, device)
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
    known = set(by_name) | {NCCL_EAGER_PIECES}  # not the fused forms' timings, kept for the record

    def measured(mode: str, nbytes: int) -> dict[str, float]:
        return {key.split("/")[0]: t[nbytes] for key, t in timings.items()
                if key.endswith("/" + mode) and nbytes in t and key.split("/")[0] in known}

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
    if every_rank(shm_all_reduce.supported(), group, cpu):  # constructing is collective
        try:
            shm = shm_all_reduce.ShmAllReduce(group, rank, world_size)
        except Exception as e:  # another host, or no shared memory
            logger.info("all-reduce: %s unavailable (%s)", SHM, e)
        if every_rank(shm is not None, group, cpu) and shm is not None:
            methods.append(shm)
    forced = envs.ALL_REDUCE.get()
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
