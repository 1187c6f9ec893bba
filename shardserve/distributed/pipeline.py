"""The pipeline's data plane: activations from one stage to the next, and the logits back to rank 0.

Every rank runs every step plan. Tensor-parallel rank t of stage s sends the residual stream of its step
([tokens, hidden], the same on every rank of the stage) to rank t of stage s + 1; the last stage's first rank,
which alone holds the gathered logits, sends the rows rank 0 samples from. Point-to-point sends on the world group:
gloo on CPUs, NCCL on GPUs. Both ends know every shape from the plan, so nothing but the tensor crosses.

Cost: one [tokens, hidden] tensor per stage boundary per step (hidden x dtype bytes a token), plus the sampled
rows' logits from the last stage to rank 0 once a step, in the dtype the LM head computes them in (agreed at
start-up: agree_logits_dtype), so rank 0 samples from the values it would have had without stages (vocab x 2 bytes
a row for a 16-bit model). Sampling on the last stage instead would send a token id a row; it is not done (rank 0
keeps the sampler, grammars and histories).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardserve.distributed.process_group import RankContext


# The dtypes an LM head computes logits in.
LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PipelineLinks:
    """This rank's neighbours in the pipeline: the same tensor-parallel rank of the stages before and after."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.previous = ctx.rank_of(ctx.stage - 1, ctx.tp_rank) if ctx.stage > 0 else None
        self.next = ctx.rank_of(ctx.stage + 1, ctx.tp_rank) if ctx.stage < ctx.pp_size - 1 else None
        self.logits_source = ctx.rank_of(ctx.pp_size - 1, 0)  # the last stage's first rank
        self.logits_dtype = torch.float32  # until agree_logits_dtype

    @property
    def sends_logits(self) -> bool:
        return self.ctx.rank == self.logits_source

    def send_hidden(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.next)

    def receive_hidden(self, tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(tokens, hidden_size, dtype=dtype, device=self.ctx.device)
        self.receive_hidden_into(x)
        return x

    def receive_hidden_into(self, x: torch.Tensor) -> None:
        """receive_hidden into x (contiguous: a decode graph's input buffer)."""
        dist.recv(x, src=self.previous)

    def agree_logits_dtype(self, computed: torch.dtype | None) -> torch.dtype:
        """Every rank's logits dtype: `computed` where this rank sends the logits (what its LM head returns), the
        sender's on the others (its index in LOGITS_DTYPES over the control plane, every rank taking part)."""
        index = torch.tensor([LOGITS_DTYPES.index(computed) if self.sends_logits else -1])
        dist.broadcast(index, src=self.logits_source, group=self.ctx.control_group)
        self.logits_dtype = LOGITS_DTYPES[int(index)]
        return self.logits_dtype

    def send_logits(self, logits: torch.Tensor) -> None:
        dist.send(logits.to(self.logits_dtype).contiguous(), dst=0)

    def receive_logits(self, rows: int, vocab_size: int) -> torch.Tensor:
        logits = torch.empty(rows, vocab_size, dtype=self.logits_dtype, device=self.ctx.device)
        dist.recv(logits, src=self.logits_source)
        return logits
