"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running sequences go first, in arrival order (a decoding sequence
needs one token, a partly prefilled one its next chunk); waiting sequences then join while budget,
sequence slots and free blocks last. When a running sequence needs a block and none is free, the
most recently admitted running sequence is preempted: its blocks are freed and it returns to the
front of the queue, to be recomputed from its tokens (prompt plus what it already generated).

Models with linear-attention layers keep a fixed-size state per sequence in one of max_num_seqs slots beside
the blocks. Invariant: a sequence holds a slot exactly while it is running (taken at admission, given back
when it finishes, is aborted or preempted), so a preempted sequence recomputes from an empty state.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from shardserve.engine.block_manager import BlockManager
from shardserve.engine.sequence import Sequence, SequenceStatus
from shardserve.wire.step_plan import FROM_DEVICE, PlanKind, SeqChunk, StepPlan

if TYPE_CHECKING:
    from shardserve.engine.speculative import Proposer


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 state_slots: bool = False, proposer: Proposer | None = None) -> None:
        """state_slots: running sequences each hold a recurrent-state slot (Sequence.state_slot). proposer: the
        tokens proposed after the decoding sequences' last ones, asked for all of them once a step and verified in
        their chunks (engine/speculative.py), and told of each sequence that stops running; None: one token a
        step."""
        self.blocks = block_manager
        self.proposer = proposer
        # Slots not held by a running sequence, the lowest handed out first; None where the model keeps no state.
        self.free_slots: list[int] | None = list(reversed(range(max_num_seqs))) if state_slots else None
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._step_id = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        chunks: list[SeqChunk] = []
        scheduled: set[int] = set()
        proposals = self._proposals()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = proposals.get(seq.seq_id, [])[:budget - 1]  # fewer where the budget runs out
            if not self._reserve(seq, n + len(drafts), scheduled):
                continue
            chunks.append(self._chunk(seq, n, drafts))
            scheduled.add(seq.seq_id)
            budget -= n + len(drafts)
        self._admit_waiting(budget, chunks)
        self._step_id += 1
        return StepPlan(self._step_id, PlanKind.RUN, chunks)

    def _proposals(self) -> dict[int, list[int]]:
        """The proposer's tokens for the running sequences that decode (one uncomputed token), by seq id."""
        if self.proposer is None:
            return {}
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        return self.proposer.proposals(decoding) if decoding else {}

    def _admit_waiting(self, budget: int, chunks: list[SeqChunk]) -> int:
        """Waiting sequences join, in order, while budget, sequence slots and free blocks last; each one's
        first chunk goes to `chunks`. Returns the tokens of budget used."""
        used = 0
        while self.waiting and budget > used and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget - used)
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                if not self.running:
                    # Nothing running will free blocks for it: shrink the chunk to what fits now.
                    room = (len(seq.block_table) + self.blocks.num_free_blocks) * self.blocks.block_size
                    n = min(n, room - seq.num_computed_tokens)
                if n <= 0 or not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                    self.blocks.free_sequence(seq)  # give back prefix-cache hits; retried next step
                    break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            if self.free_slots is not None:
                seq.state_slot = self.free_slots.pop()  # one is free: fewer than max_num_seqs are running
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            used += n
        return used

    def schedule_ahead(self, sampling: list[Sequence], max_model_len: int) -> StepPlan | None:
        """The step after the one in flight, planned before that step's sampled tokens reach the host.

        `sampling` are the sequences that sample a token in the step in flight, in its sample order. Each
        decodes that token next: its chunk is one FROM_DEVICE token, which the model runner takes from the
        device, and these chunks come first, in `sampling` order. Then, as in schedule(), the other running
        sequences go on with their prompts and waiting sequences join while budget, slots and free blocks
        last. A sequence that surely finishes on the token in flight (its length limit) gets no chunk; one
        that finishes on it by a stop token has the extra token discarded, and its slot goes to a waiting
        sequence a step later. None where the step cannot be planned without preempting (a running sequence
        needs a block that is not free), or where there is nothing to run.

        Invariant: for each of `sampling` still running, num_computed_tokens == num_tokens (the step in
        flight computed its last token) and the token in flight will go to position num_tokens.
        """
        budget = self.max_num_batched_tokens
        chunks: list[SeqChunk] = []
        ahead = set()
        blocks, running = self.blocks, SequenceStatus.RUNNING
        # Every step of a decoding batch runs this loop over every sequence: a sequence is only asked for a new
        # block where its new position starts one.
        for seq in sampling:
            if seq.status is not running:
                continue  # aborted while its step was in flight
            ahead.add(seq.seq_id)
            position = len(seq.token_ids)  # where the token in flight goes
            if len(seq.output_token_ids) + 1 >= seq.params.max_tokens or position + 1 >= max_model_len:
                continue  # its last token is the one in flight
            if budget == 0:
                return None
            if blocks.blocks_needed(seq, position + 1):
                if not blocks.can_allocate(seq, position + 1):
                    return None
                blocks.allocate(seq, position + 1)
            chunks.append(SeqChunk(seq.seq_id, position, [FROM_DEVICE], seq.block_table.copy(), True,
                                   seq.state_slot))
            budget -= 1
        num_device_tokens = len(chunks)
        # The running sequences that did not sample (prompts in chunks); none where every one decodes on (`ahead`
        # holds running sequences only).
        others = () if len(ahead) == len(self.running) else [s for s in self.running if s.seq_id not in ahead]
        for seq in others:
            if budget == 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                continue
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                return None
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            chunks.append(self._chunk(seq, n))
            budget -= n
        self._admit_waiting(budget, chunks)
        if not chunks:
            return None
        self._step_id += 1
        return StepPlan(self._step_id, PlanKind.RUN, chunks, tokens_from_device=num_device_tokens > 0)

    def _reserve(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Make room for n more tokens of a running sequence, preempting later arrivals if needed."""
        while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), None)
            if victim is None or victim is seq:
                self._preempt(seq)
                return False
            self._preempt(victim)
        self.blocks.allocate(seq, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back what a sequence holds beside its blocks while it runs: its state slot, what the proposer keeps
        for it."""
        if self.proposer is not None:
            self.proposer.release(seq)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def _chunk(self, seq: Sequence, n: int, drafts: list[int] = ()) -> SeqChunk:
        start = seq.num_computed_tokens
        sample = start + n == seq.num_tokens
        return SeqChunk(seq.seq_id, start, seq.token_ids[start:start + n] + list(drafts), list(seq.block_table),
                        sample, seq.state_slot, len(drafts))

    def finish_step(self, plan: StepPlan, seqs: dict[int, Sequence]) -> None:
        """Record that the plan's chunks are now in the cache (a verified chunk's proposals once accepted:
        accept_drafts)."""
        for chunk in plan.chunks:
            seq = seqs.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = chunk.start_position + len(chunk.token_ids) - chunk.draft
            self.blocks.register_computed(seq)

    def accept_drafts(self, seq: Sequence, accepted: int) -> None:
        """`accepted` proposals of the sequence's verified chunk were appended to it: their entries, computed in
        that chunk, count as in the cache."""
        seq.num_computed_tokens += accepted
        self.blocks.register_computed(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and return its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        self._release(seq)
