"""A request as the scheduler sees it: its tokens, how many are in the KV cache, and its blocks."""

from __future__ import annotations

import enum
import itertools

from shardserve.requests.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt followed by every generated token
        self.output_token_ids: list[int] = []  # the generated tokens alone (append_token keeps both)
        self.params = params
        self.status = SequenceStatus.WAITING
        # Invariant: the first num_computed_tokens of token_ids have their keys/values in the blocks
        # of block_table; the rest are still to be computed (the last sampled token, or a prompt chunk).
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # the first blocks of block_table whose hashes are registered (BlockManager)
        self.state_slot = -1  # its slot in the recurrent-state pools while running (Scheduler), else -1
        self.finish_reason: str | None = None
        # Speculative decoding: tokens proposed for it and accepted (engine/speculative.py stops_paying).
        self.spec_proposed = self.spec_accepted = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)
        self.output_token_ids.append(token)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")
