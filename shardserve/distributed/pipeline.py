"""The pipeline's data plane: activations from one stage to the next, and the logits back to rank 0.

Every rank runs every step plan. Tensor-parallel rank t of stage s sends the residual stream of its step
([tokens, hidden], the same on every rank of the stage) to rank t of stage s + 1; the last stage's first rank,
which alone holds the gathered logits, sends the rows rank 0 samples from. Point-to-point sends on the world group:
gloo on CPUs, NCCL on GPUs. Both ends know every shape from the plan, so nothing but the tensor crosses.

Cost: one [tokens, hidden] tensor per stage boundary per step (hidden x dtype bytes a token), plus the sampled
rows' float32 logits (vocab x 4 bytes a row) from the last stage to rank 0 once a step. Sampling on the last stage
instead would send a token id a row; it is not done (rank 0 keeps the sampler, grammars and histories).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardserve.distributed.process_group import RankContext


class PipelineLinks:
    """This rank's neighbours in the pipeline: the same tensor-parallel rank of the stages before and after."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.previous = ctx.rank_of(ctx.stage - 1, ctx.tp_rank) if ctx.stage > 0 else None
        self.next = ctx.rank_of(ctx.stage + 1, ctx.tp_rank) if ctx.stage < ctx.pp_size - 1 else None
        self.logits_source = ctx.rank_of(ctx.pp_size - 1, 0)  # the last stage's first rank

    @property
    def sends_logits(self) -> bool:
        return self.ctx.rank == self.logits_source

    def send_hidden(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.next)

    def receive_hidden(self, tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(tokens, hidden_size, dtype=dtype, device=self.ctx.device)
        dist.recv(x, src=self.previous)
        return x

    def receive_hidden_into(self, x: torch.Tensor) -> None:
        """receive_hidden into x (contiguous: a decode graph's input buffer)."""
        dist.recv(x, src=self.previous)

    def send_logits(self, logits: torch.Tensor) -> None:
        dist.send(logits.float().contiguous(), dst=0)

    def receive_logits(self, rows: int, vocab_size: int) -> torch.Tensor:
        logits = torch.empty(rows, vocab_size, dtype=torch.float32, device=self.ctx.device)
        dist.recv(logits, src=self.logits_source)
        return logits
