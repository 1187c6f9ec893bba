"""Turns rank 0's logits into next tokens: greedy, temperature, top-k, top-p, seeds and logprobs."""

from __future__ import annotations

import torch

from shardserve.engine.outputs import TokenLogprob
from shardserve.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int) -> None:
        self.default_generator = torch.Generator().manual_seed(seed)
        self._generators: dict[int, torch.Generator] = {}  # seq id -> its own seeded generator

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, seq_ids: list[int], params: list[SamplingParams]
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [n, vocab] float32 on the CPU, one row per sequence."""
        greedy = logits.argmax(dim=-1).tolist()
        tokens = [greedy[i] if p.greedy else self._sample_row(logits[i], seq_ids[i], p)
                  for i, p in enumerate(params)]
        logprobs = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            all_logprobs = torch.log_softmax(logits[wanted], dim=-1)
            for row, i in enumerate(wanted):
                logprobs[i] = _token_logprob(all_logprobs[row], tokens[i], params[i].logprobs)
        return tokens, logprobs

    def _sample_row(self, logits: torch.Tensor, seq_id: int, p: SamplingParams) -> int:
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set of tokens whose mass reaches top_p (always at least the best one).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq_id, p)).item())

    def _generator(self, seq_id: int, p: SamplingParams) -> torch.Generator:
        if p.seed is None:
            return self.default_generator
        if seq_id not in self._generators:
            self._generators[seq_id] = torch.Generator().manual_seed(p.seed)
        return self._generators[seq_id]


def _token_logprob(logprobs: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logprobs[token]), top)
