"""Vocabulary-parallel token embedding and LM head.

Rank r owns vocabulary rows [r * P, (r + 1) * P) with P = ceil(vocab / tp); rows past the real
vocabulary are zero padding, and their logits are cut off after the gather.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers.linear import KernelLinear, copy_exact


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, comm: Communicator) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.comm = comm
        self.rows_per_rank = -(-vocab_size // comm.world_size)
        self.start = comm.rank * self.rows_per_rank
        self.end = min(self.start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        if self.end > self.start:
            copy_exact(param.data[: self.end - self.start], loaded[self.start:self.end])

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(x)


class ParallelLMHead(KernelLinear):
    """Logits over the whole vocabulary, gathered to the first rank only (it alone samples).

    Untied, it may be kept packed (a GPTQ checkpoint with `lm_head: true`: layers/quantization/): its rows
    past the real vocabulary are then zero codes and zero scales, so their logits are zeros, cut off as above."""

    def __init__(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        super().__init__()
        self.comm = embedding.comm
        self.vocab_size = embedding.vocab_size
        self.tied = tied
        self.start, self.end = embedding.start, embedding.end
        if tied:
            # The same Parameter as the embedding's, loaded once. A kernel that prepares its own
            # layout gives the head a copy (KernelLinear.use_kernel), the embedding keeps plain rows.
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.zeros_like(embedding.weight), requires_grad=False)
            self.weight.weight_loader = self._load_rows

    def _load_dense_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        """The same rows of the vocabulary as the embedding's."""
        if self.end > self.start:
            copy_exact(param.data[: self.end - self.start], loaded[self.start:self.end])

    def _load_rows(self, param: nn.Parameter, loaded: Any, shard_id: Hashable = None) -> None:
        if self.packed is None:
            self._load_dense_rows(param, loaded, shard_id)
            return
        rows = max(self.end - self.start, 0)
        if rows:
            self.packed.load(self, loaded, slice(0, rows), (self.start, self.end), None, shard_id)
        for part in (self.weight, self.weight_scale, getattr(self, "weight_row_scale", None)):
            if part is not None:  # the padding rows: no weights, no scales
                part.data[rows:].zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local_logits = self.matmul(hidden)
        logits = self.comm.gather_last_dim_to_first(local_logits)
        return None if logits is None else logits[..., : self.vocab_size]
