"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step of n sequences runs the graph of the smallest bucket >= n; rows [n, bucket) are
padding: their slot is -1 (nothing stored) and their context length 0 (attention outputs zeros), and
their logits are never read. Invariants: the static input buffers are the only inputs a graph
reads, so they are written before each replay; every rank captures the same buckets in the same
order and replays the same bucket each step (all ranks run the same plan), so the collectives inside
the graphs pair up. The static buffers are written by the graph's first kernel, from one array of words the
host copies before the replay (engine/graph_inputs.py).

Where the all-reduce choice says NCCL run eagerly beats every in-graph method at a bucket's message
size (see distributed/all_reduce.py), that bucket's graph is captured in pieces split at each
all-reduce, and the all-reduces run eagerly between the pieces.

Verifying speculative proposals (engine/speculative.py) puts a sequence's last token and its k proposals in one step:
those steps run as decode rows too (StepBatch.decode_rows: k + 1 one-token rows of one sequence, each attending
up to its own position), from a second set of graphs captured with every row's key stored before any row attends
(the decode launch that stores its own row's key serves one row a sequence only). Their buckets go up to
max_num_seqs sequences of k + 1 rows.

Across GPUs of one host (peer memory), each graph begins with the broadcast of rank 0's input tokens
(distributed/token_broadcast.py): only rank 0 writes them before a replay, and the other ranks' graphs wait
for them inside, so no eager collective runs between two replays.

A pipeline stage (distributed/pipeline.py) captures its own layers only: a stage after the first reads the residual
stream from a static buffer (stage_input), which the runner receives into before the replay, and every stage but
the last returns the stream it computed, which the runner sends on after it; the last returns logits. The sends and
receives stay outside the graphs, so a stage's replay never waits inside for another stage.
"""

from __future__ import annotations

import collections
import gc
import logging
import time
from typing import Callable

import torch

from shardserve import envs
from shardserve.attention.batch import StepBatch
from shardserve.config import PipelineStage
from shardserve.distributed.communicator import Communicator
from shardserve.engine.graph_inputs import GraphInputs
from shardserve.wire.step_plan import SeqChunk

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def all_reduce_token_counts(max_num_seqs: int, max_num_batched_tokens: int, rows_per_sequence: int = 1) -> list[int]:
    """The step sizes (tokens) whose all-reduce messages start-up times and sizes buffers for: every graph's batch
    and the largest step."""
    return sorted(set(graph_buckets(graph_rows(max_num_seqs, max_num_batched_tokens, rows_per_sequence)))
                  | {max_num_batched_tokens})


def graph_rows(max_num_seqs: int, max_num_batched_tokens: int, rows_per_sequence: int = 1) -> int:
    """The most rows a graphed step has: max_num_seqs sequences of rows_per_sequence rows (1 to decode, k + 1 to
    verify k proposals), within a step's token budget and the largest bucket."""
    return max(max_num_seqs, min(max_num_seqs * rows_per_sequence, max_num_batched_tokens, BUCKETS[-1]))


def graph_buckets(max_batch: int) -> list[int]:
    buckets = [b for b in BUCKETS if b <= max_batch]
    if not buckets or buckets[-1] < max_batch <= BUCKETS[-1]:
        buckets.append(max_batch)
    return buckets


class PiecewiseGraph:
    """A graph captured as pieces with eager calls between them: replay runs piece, call, piece, ..."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.between: list[Callable[[], None]] = []
        self._current: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._current = torch.cuda.CUDAGraph()
        self._current.capture_begin(pool=self.pool)

    def split(self, call: Callable[[], None]) -> None:
        """End the current piece at an eager call (not run now: capturing computes nothing) and start the next."""
        self._current.capture_end()
        self.graphs.append(self._current)
        self.between.append(call)
        self.begin()

    def end(self) -> None:
        self._current.capture_end()
        self.graphs.append(self._current)
        self._current = None

    def replay(self) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.between):
                self.between[i]()


class ReplayTimer:
    """SHARDSERVE_GRAPH_TIMING=1: CUDA events around every replay, and at close the mean time a step spends
    inside its graph and between two graphs, logged by each rank (where the ranks of a step wait: a rank whose
    graphs take longer than the others' waits inside them for a peer)."""

    KEPT = 4096

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event]] = collections.deque(maxlen=self.KEPT)

    @staticmethod
    def wanted() -> bool:
        return envs.GRAPH_TIMING.get()

    def around(self, replay: Callable[[], None]) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        self.events.append((start, end))

    def report(self) -> None:
        if len(self.events) < 2:
            return
        self.events[-1][1].synchronize()
        events = list(self.events)
        inside = [s.elapsed_time(e) for s, e in events]
        between = [e.elapsed_time(s) for (_, e), (s, _) in zip(events, events[1:])]
        between = [ms for ms in between if ms < 1.0]  # a step queued after an idle host is not a gap
        logger.info("rank %d: %d graph replays, %.3f ms inside a graph, %.3f ms between two (mean of %d)",
                    self.rank, len(inside), sum(inside) / len(inside), sum(between) / max(len(between), 1),
                    len(between))


def layer_caches(cfg, kv_caches: list, state_pools: dict, slots, starts, stage: PipelineStage | None = None) -> list:
    """Each layer's cache in layer order, of the stage's layers (all without one): the next KV cache for each of
    cfg.kv_layers, (its pool, slots, starts) for a layer with a state pool, None for any other layer."""
    kv, kv_layers = iter(kv_caches), set(cfg.kv_layers)
    layers = range(cfg.num_layers) if stage is None else stage.layers
    return [(state_pools[i], slots, starts) if i in state_pools else next(kv) if i in kv_layers else None
            for i in layers]


def graph_unsafe_reason(module) -> str:
    """Why a module whose graph_safe is False cannot be captured, as its `graph_unsafe_reason` says."""
    return getattr(module, "graph_unsafe_reason", f"{type(module).__name__} synchronises with the host")


class CudaGraphRunner:
    def __init__(self, model, kv_caches, backend, comm: Communicator, max_batch: int, max_model_len: int,
                 split_sizes: frozenset[int], hidden_bytes_per_token: int, state_pools: dict | None = None,
                 max_shared_rows: int = 0, stage: PipelineStage | None = None,
                 stream_dtype: torch.dtype | None = None) -> None:
        """state_pools: a hybrid model's recurrent-state pools by layer (engine/model_runner.py); its decode
        graphs read each row's slot in them from a static buffer, and padding rows' slot -1 steps no state.
        max_shared_rows: the most rows of steps whose rows share sequences (verification, StepBatch.decode_rows),
        or 0 where none are graphed. stage: this rank's pipeline stage (the module docstring), whose residual
        stream is of stream_dtype."""
        self.model = model
        self.kv_caches = kv_caches
        self.state_pools = state_pools or {}
        self.backend = backend
        self.comm = comm
        self.buckets = graph_buckets(max_batch)
        # Graphs whose rows share sequences (the module docstring): two rows and more.
        self.shared_buckets = [b for b in graph_buckets(max_shared_rows) if b > 1] if max_shared_rows > 1 else []
        self.max_batch = max(self.buckets + self.shared_buckets)
        self.max_model_len = max_model_len
        self.split_sizes = split_sizes  # all-reduce message bytes whose graphs are captured in pieces
        self.hidden_bytes_per_token = hidden_bytes_per_token
        device = backend.device
        self.token_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.state_slots = torch.full((self.max_batch,), -1, dtype=torch.long, device=device)
        self.stage = stage
        # A later stage's input: the stream rows [0, n) of a step of n rows, received before each replay; the
        # padding rows past n keep an earlier step's finite values, which no cache or state keeps.
        self.hidden_in = None
        if stage is not None and not stage.is_first:
            self.hidden_in = torch.zeros(self.max_batch, model.config.hidden_size, dtype=stream_dtype, device=device)
        max_blocks = -(-max_model_len // backend.block_size)
        self.static_meta = backend.static_decode_metadata(self.max_batch, max_blocks)
        meta = self.static_meta
        self.inputs = GraphInputs(self.token_ids, self.positions, meta.slot_mapping, meta.decode_context_lens,
                                  self.state_slots, meta.decode_block_tables)
        self.pool = torch.cuda.graph_pool_handle()
        # By (rows, whether rows share sequences).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph | PiecewiseGraph] = {}
        # Each graph's output: logits (None on ranks that hold none), or a stage's residual stream before the last.
        self.outputs: dict[tuple[int, bool], torch.Tensor | None] = {}
        # Each graph's first kernel takes the input tokens from rank 0 (peer memory): the other ranks write none.
        self.shares_tokens = comm.tokens is not None
        self.timer = ReplayTimer(comm.rank) if ReplayTimer.wanted() else None

    def decode_graph(self, size: int):
        """The decode graph of `size` rows (one a sequence), for timing its replay."""
        return self.graphs[size, False]

    def can_run(self, batch: StepBatch) -> bool:
        if not batch.decode_only or batch.num_decode == 0:
            return False
        buckets = self.shared_buckets if batch.rows_share_sequences else self.buckets
        return bool(buckets) and batch.num_decode <= buckets[-1]

    def takes_as_rows(self, chunks: list[SeqChunk], max_chunk_tokens: int) -> bool:
        """Whether a step's chunks replay a graph as StepBatch.decode_rows: some chunk is longer than one token (a
        step of one-token chunks is a decode step already), none longer than max_chunk_tokens (a sequence's rows to
        verify), and all their rows fit a graph."""
        if not self.shared_buckets:
            return False
        lengths = [len(c.token_ids) for c in chunks]
        longest = max(lengths, default=0)
        return 1 < longest <= max_chunk_tokens and sum(lengths) <= self.shared_buckets[-1]

    @torch.inference_mode()
    def capture_all(self) -> None:
        started = time.perf_counter()
        pieces = 0
        keys = [(size, False) for size in self.buckets] + [(size, True) for size in self.shared_buckets]
        for key in sorted(keys, reverse=True):  # largest first, so smaller graphs reuse its pool memory
            size, shared = key
            meta = self.backend.graph_view(self.static_meta, size, self.max_model_len, rows_share_sequences=shared)
            forward = self._forward_fn(size, meta)
            forward()  # warm up: compiles kernels, creates library handles, outside any capture
            torch.cuda.synchronize()
            if size * self.hidden_bytes_per_token in self.split_sizes:
                self.graphs[key], self.outputs[key] = self._capture_pieces(forward)
                pieces += 1
            else:
                self.graphs[key], self.outputs[key] = self._capture_whole(forward)
        gc.collect()
        torch.cuda.synchronize()
        shared = (f", {len(self.shared_buckets)} of rows that share sequences (2 to {self.shared_buckets[-1]})"
                  if self.shared_buckets else "")
        logger.info("CUDA graphs: captured %d decode batch sizes (1 to %d)%s%s in %.1f s", len(self.buckets),
                    self.buckets[-1], shared, f", {pieces} split at all-reduces" if pieces else "",
                    time.perf_counter() - started)

    def _forward_fn(self, size: int, meta) -> Callable[[], torch.Tensor | None]:
        def forward():
            self.inputs.unpack(size)
            if self.shares_tokens:
                self.comm.broadcast_from_first(self.token_ids[:size])
            staged = () if self.stage is None else (None if self.hidden_in is None else self.hidden_in[:size],)
            hidden = self.model(self.token_ids[:size], self.positions[:size], self._layer_caches(size), meta,
                                *staged)
            return hidden if self.stage is not None and not self.stage.is_last else self.model.compute_logits(hidden)
        return forward

    def stage_input(self, rows: int) -> torch.Tensor:
        """Where a later pipeline stage receives a step's residual stream of `rows` rows before its replay."""
        return self.hidden_in[:rows]

    def _layer_caches(self, size: int) -> list:
        """What each layer reads and writes in a graph of `size` rows: its KV cache (a pipeline stage's layers'
        only), or for a linear-attention layer (its state pool, the rows' static slots, None: one token a row)."""
        cfg = self.model.config
        if not self.state_pools and len(cfg.kv_layers) == cfg.num_layers:
            return self.kv_caches
        return layer_caches(cfg, self.kv_caches, self.state_pools, self.state_slots[:size], None, self.stage)

    def _capture_whole(self, forward):
        graph = torch.cuda.CUDAGraph()
        with self.comm.capturing(), torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return graph, out

    def _capture_pieces(self, forward):
        graph = PiecewiseGraph(self.pool)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self.comm.capturing(split_piece=graph.split):
            graph.begin()
            out = forward()
            graph.end()
        torch.cuda.current_stream().wait_stream(stream)
        return graph, out

    def run(self, batch: StepBatch, device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay the decode step for `batch`; returns logits for its rows (rank 0), None elsewhere; a pipeline
        stage before the last returns the residual stream of its rows, the last its logits where it holds them.

        With `device_tokens` (the previous step's samples) the graph's first kernel reads the input tokens from
        them and the host never waits: the one host-to-device copy here is from pinned memory, queued in
        stream order.
        Where the graphs share tokens, only rank 0 writes them (device_tokens is None on the others).
        """
        n = batch.num_decode
        shared = batch.rows_share_sequences
        size = next(b for b in (self.shared_buckets if shared else self.buckets) if b >= n)
        writes_tokens = not self.shares_tokens or self.comm.rank == 0
        if device_tokens is not None and not (device_tokens.dtype == torch.long and device_tokens.is_contiguous()):
            device_tokens = device_tokens.to(torch.long).contiguous()
        self.inputs.write(batch, size, device_tokens, host_tokens=writes_tokens)
        graph = self.graphs[size, shared]
        if self.timer is not None:
            self.timer.around(graph.replay)
        else:
            graph.replay()
        out = self.outputs[size, shared]
        return None if out is None else out[:n]

