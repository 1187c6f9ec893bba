"""Rank 0's grammar matchers: one per constrained sequence, stepped with its tokens, giving the sampler the
tokens each row may take next.

Invariant: a sequence's matcher has consumed exactly its output tokens, so the mask it computes is that of
the next token. The engine never queues a step ahead of a constrained row (SamplingParams.needs_last_token),
so every token reaches the matcher before the next mask is asked for.

The masks of a batch are filled by llguidance's own threads, without the GIL, into one int32 bitmask
[rows, ceil(vocab / 32)] (bit t % 32 of word t // 32: token t is allowed); on a GPU this host work runs while
the device computes the step's logits, since the engine asks for the masks after queueing the forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import torch

from shardserve.engine.grammar import check
from shardserve.requests.sampling_params import StructuredOutput
from shardserve.transfers import on_device

if TYPE_CHECKING:
    from shardserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_STARTED_KEPT = 256  # constraints whose start matcher is kept, oldest dropped first


@dataclass
class AllowedTokens:
    """Which tokens some rows of a batch may sample: `bitmask` [len(rows), words] int32 on the host."""

    rows: list[int]
    bitmask: torch.Tensor


class StructuredOutputs:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the width of the logits, which may exceed the tokenizer's
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built at the first constrained request (~0.3 s)
        self._executor: llguidance.LLExecutor | None = None
        self.matchers: dict[int, llguidance.LLMatcher] = {}
        # Per constraint, a matcher at its start: a copy of it starts the next request with the same schema in
        # about 0.01 ms, against 0.3 to 1.3 ms to build one (benchmarks/grammar_backends.py).
        self._started: dict[StructuredOutput, llguidance.LLMatcher] = {}

    def add(self, seq_id: int, structured: StructuredOutput) -> None:
        """Start a sequence's matcher; ValueError (a refused request) when the constraint does not compile."""
        start = self._started.get(structured)
        if start is None:
            start = llguidance.LLMatcher(self._tokenizer_info(), check(structured), log_level=0)
            if start.is_error():
                raise ValueError(f"the structured output's grammar does not compile: {start.get_error()}")
            if len(self._started) >= _STARTED_KEPT:
                self._started.pop(next(iter(self._started)))
            self._started[structured] = start
        self.matchers[seq_id] = start.deep_copy()

    def forget(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def allowed(self, seq_ids: list[int]) -> AllowedTokens | None:
        """The masks of the constrained rows among `seq_ids` (the rows of a batch), or None if none is."""
        rows = [r for r, seq_id in enumerate(seq_ids) if seq_id in self.matchers]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        matchers = [(self.matchers[seq_ids[r]], i) for i, r in enumerate(rows)]
        # Row i of the bitmask is written by matcher i, at data_ptr + i * (words * 4); llguidance's threads.
        self._executor_for_masks().unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(rows))
        return AllowedTokens(rows, bitmask)

    def accept(self, seq_id: int, token_id: int) -> bool:
        """Step a sequence's matcher with its new token. Returns whether the output ends with this token: the
        grammar was complete, so its mask allowed only an end-of-sequence token, and this is it (that token
        ends the output even under ignore_eos, and like any stop token is not part of the text)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return False
        if matcher.is_stopped():
            return True
        if not matcher.consume_token(token_id):
            # The mask allowed only tokens the matcher accepts: this is a bug, not a model's choice. End the
            # output here (without this token) rather than let it leave the grammar.
            logger.error("sequence %d: the grammar refused token %d it allowed: %s", seq_id, token_id,
                         matcher.get_error())
            return True
        return False

    def _tokenizer_info(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            # An end-of-sequence id the tokenizer does not have (a config's, past its vocabulary) is no token the
            # grammar could allow.
            eos = [t for t in self._eos_token_ids if t < self._tokenizer.vocab_size]
            import llguidance.hf  # imports transformers: only where a grammar is used (a rank or `plan` need none)

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos or None)
            except (ValueError, RuntimeError) as exc:  # e.g. a word-level vocabulary: no bytes to spell with
                raise ValueError(f"structured outputs need a tokenizer whose tokens are bytes or text pieces, and "
                                 f"the grammar engine cannot read this model's ({exc})") from None
        return self._ll_tokenizer

    def _executor_for_masks(self) -> llguidance.LLExecutor:
        if self._executor is None:
            # llguidance's default: 80% of the cores, up to 32. On a 16-core GPU host a batch of 256 JSON rows took
            # 6.6 ms a step with it and 7.9 ms with 4 threads in the engine (benchmarks/constrained_decoding.py),
            # though 4 threads won in the mask-only benchmark (benchmarks/grammar_backends.py).
            self._executor = llguidance.LLExecutor()
        return self._executor


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """-inf on the tokens the rows' grammars do not allow, in float `logits` [n, vocab] on any device."""
    vocab = logits.shape[-1]
    device = logits.device
    words = allowed.bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words.unsqueeze(-1) >> shifts).bitwise_and_(1)  # [rows, words, 32]: token 32 w + b is bit b of word w
    refused = bits.view(len(allowed.rows), -1)[:, :vocab] == 0
    rows = on_device(allowed.rows, device)
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(refused, float("-inf")))
