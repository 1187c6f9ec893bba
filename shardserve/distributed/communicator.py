"""The tensor-parallel data plane: the few collectives the model needs, behind one small interface.

Every rank of a group must call the same collectives in the same order; the engine guarantees that
by having all ranks execute the same step plan.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from shardserve.distributed.all_reduce import AllReduceChoice, AllReduceMethod, gemv_add_on

if TYPE_CHECKING:
    from shardserve.distributed.token_broadcast import PeerTokenBroadcast


class Normed:
    """The pending reduction of an output that its row-parallel layer's kernel already all-reduced, added to the
    residual and normalised with the next norm (RowParallelLinear.forward_add): the next layer takes the output
    as that norm's, as is. Passed where a Communicator says that a reduction is still to do."""

    def __repr__(self) -> str:
        return "NORMED"


NORMED = Normed()


def reduced_first(x: torch.Tensor, residual: torch.Tensor | None, norm, reduce):
    """(x, residual, reduce) with x's pending reduction done, as a layer on norm(x + residual) starts (`norm`: an
    RMSNorm module): where the communicator fuses the all-reduce, the add and the norm, (norm(s), s, NORMED); else
    the all-reduced x, the residual and None. Without one (None or NORMED) as they are."""
    if reduce is None or reduce is NORMED:
        return x, residual, reduce
    fused = reduce.all_reduce_add_rms_norm(x, residual, norm.weight, norm.eps)
    if fused is not None:
        return fused[0], fused[1], NORMED
    return reduce.all_reduce(x), residual, None


class Communicator:
    """All-reduce and gathers of activations over one tensor-parallel group.

    Outside CUDA graphs all-reduces go through the eager size table, inside a graph capture through
    the graph table; while a graph is captured in pieces, each all-reduce ends the current piece and
    runs eagerly between pieces (see engine/cuda_graphs.py).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.choice: AllReduceChoice | None = None  # None: plain dist.all_reduce (CPU, or not calibrated)
        # Rank 0's sampled tokens to the others through peer memory (GPUs of one host), else NCCL.
        self.tokens: PeerTokenBroadcast | None = None
        self._in_graph = False
        self._split_piece: Callable[[Callable[[], None]], None] | None = None

    def use(self, choice: AllReduceChoice) -> None:
        self.choice = choice

    @contextlib.contextmanager
    def capturing(self, split_piece: Callable[[Callable[[], None]], None] | None = None) -> Iterator[None]:
        """While a CUDA graph is captured: graph-table methods, or with `split_piece` eager NCCL between pieces."""
        methods = [m for m in self._methods() if hasattr(m, "begin_capture")]
        for m in methods:
            m.begin_capture()
        self._in_graph, self._split_piece = True, split_piece
        try:
            yield
        finally:
            self._in_graph, self._split_piece = False, None
            for m in methods:
                m.end_capture()

    def _methods(self) -> list[AllReduceMethod]:
        """The chosen methods, each once (one may stand in both tables)."""
        return [] if self.choice is None else self.choice.methods()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group. Use the returned tensor (a method may reduce into a new one)."""
        if self.world_size == 1:
            return x
        if self._split_piece is not None:
            self._split_piece(lambda: dist.all_reduce(x, group=self.group))
            return x
        if self.choice is None:
            dist.all_reduce(x, group=self.group)
            return x
        table = self.choice.graph if self._in_graph else self.choice.eager
        return table.pick(x)(x)

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(s) * weight, s) with s = (x summed over the group) + residual, in one kernel, where the
        method chosen for x's size has that fused form (peer-memory one-shot); None elsewhere or without a
        residual, and the caller reduces and normalises in two steps. x and residual may be overwritten; use
        the returned pair."""
        if self.world_size == 1 or self.choice is None or self._split_piece is not None or residual is None:
            return None
        fused = getattr((self.choice.graph if self._in_graph else self.choice.eager).pick(x), "add_rms_norm", None)
        return fused(x, residual, weight, eps) if fused is not None else None

    def gemv_add(self, residual: torch.Tensor, block_n: int) -> Callable[..., torch.Tensor] | None:
        """The method that adds a row-parallel GEMV's output, summed over the group, to `residual` and normalises
        the sum in the GEMV's own launch (IpcOneShotAllReduce.gemv_add), where the method chosen for the residual's
        size has that form and SHARDSERVE_GEMV_ALL_REDUCE allows it; else None."""
        if self.world_size == 1 or self.choice is None or self._split_piece is not None or not gemv_add_on():
            return None
        method = (self.choice.graph if self._in_graph else self.choice.eager).pick(residual)
        takes = getattr(method, "takes_gemv", None)
        return method.gemv_add if takes is not None and takes(residual, block_n) else None

    def close(self) -> None:
        """Free what the chosen methods hold on the device (peer memory). Every rank calls it at shutdown,
        once no kernel that uses it can still run."""
        for method in self._methods():
            close = getattr(method, "close", None)
            if close is not None:
                close()
        self.choice = None
        if self.tokens is not None:
            self.tokens.close()
            self.tokens = None

    def broadcast_from_first(self, x: torch.Tensor) -> None:
        """Overwrite x on every rank with the group's first rank's x (the sampled tokens of a step computed
        ahead, which only rank 0 has). On GPUs this is queued on the stream: the host does not wait. Capturable
        in CUDA graphs where `tokens` is set (peer memory)."""
        if self.tokens is not None and self.tokens.supports(x):
            self.tokens(x)
        elif self.world_size > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(x, src=src, group=self.group)

    def gather_last_dim_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate each rank's x along the last dimension, in rank order, on the group's first rank only."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            # NCCL: an all-gather (which CUDA graphs capture cleanly); only rank 0 uses the result.
            parts = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(parts, x, group=self.group)
            return torch.cat(parts.unbind(0), dim=-1) if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        gathered = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, gathered, dst=dst, group=self.group)
        return torch.cat(gathered, dim=-1) if gathered is not None else None


SINGLE = Communicator(None, 0, 1)
