"""Continuous batching decisions of the real Scheduler over a real BlockManager (no model)."""

from __future__ import annotations

from shardserve.engine.block_manager import BlockManager
from shardserve.engine.scheduler import Scheduler
from shardserve.engine.sequence import Sequence, SequenceStatus
from shardserve.requests.sampling_params import SamplingParams
from shardserve.wire.step_plan import StepPlan

BS = 4


class Harness:
    """Drives a scheduler the way LLMEngine.step does, with a fixed "sampled" token."""

    def __init__(self, num_blocks: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 enable_prefix_caching: bool = True, state_slots: bool = False) -> None:
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, state_slots)
        self.seqs: dict[int, Sequence] = {}

    def add(self, name: str, prompt_len: int, max_tokens: int = 4, first_token: int = 100) -> Sequence:
        seq = Sequence(name, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens=max_tokens))
        self.seqs[seq.seq_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        self._check_plan(plan)
        self.sched.finish_step(plan, self.seqs)
        for chunk in plan.chunks:
            if chunk.sample:
                seq = self.seqs[chunk.seq_id]
                seq.append_token(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    del self.seqs[seq.seq_id]
        return plan

    def _check_plan(self, plan: StepPlan) -> None:
        assert plan.num_tokens <= self.sched.max_num_batched_tokens
        assert len({c.seq_id for c in plan.chunks}) == len(plan.chunks), "a sequence appears twice in one step"
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for chunk in plan.chunks:
            seq = self.seqs[chunk.seq_id]
            assert seq.status is SequenceStatus.RUNNING
            end = chunk.start_position + len(chunk.token_ids)
            # The chunk continues exactly where the cache ends, and its blocks can hold it.
            assert chunk.start_position == seq.num_computed_tokens
            assert chunk.token_ids == seq.token_ids[chunk.start_position:end]
            assert len(chunk.block_table) * BS >= end
            assert chunk.sample == (end == seq.num_tokens)
            assert chunk.state_slot == seq.state_slot
        slots = [c.state_slot for c in plan.chunks if c.state_slot >= 0]
        assert len(set(slots)) == len(slots), "two sequences share a state slot in one step"
        # Blocks held by sequences in this plan are never shared unless they are cached prefix blocks.
        owners: dict[int, int] = {}
        for seq in self.sched.running:
            for b in seq.block_table:
                if b in owners:
                    assert self.bm.blocks[b].hash is not None, f"block {b} shared but not a cached prefix block"
                owners[b] = seq.seq_id

    def run_to_completion(self, max_steps: int = 200) -> list[StepPlan]:
        plans = []
        while self.sched.has_work():
            plans.append(self.step())
            assert len(plans) < max_steps, "scheduler made no progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        return plans


def test_chunked_prefill_respects_token_budget_and_only_last_chunk_samples():
    h = Harness(num_blocks=32, max_num_batched_tokens=8)
    seq = h.add("long", prompt_len=21, max_tokens=2)
    plans = [h.step() for _ in range(3)]
    chunks = [p.chunks[0] for p in plans]
    assert [(c.start_position, len(c.token_ids)) for c in chunks] == [(0, 8), (8, 8), (16, 5)]
    assert [c.sample for c in chunks] == [False, False, True]
    assert seq.num_output_tokens == 1, "a token is sampled only after the whole prompt is in the cache"
    # Next step decodes one token.
    decode = h.step().chunks[0]
    assert (decode.start_position, len(decode.token_ids), decode.sample) == (21, 1, True)
    assert seq.is_finished


def test_budget_shared_between_sequences_never_exceeded():
    h = Harness(num_blocks=64, max_num_batched_tokens=10)
    for i in range(4):
        h.add(f"r{i}", prompt_len=7 + 3 * i, max_tokens=5, first_token=100 + 50 * i)
    plans = h.run_to_completion()
    assert max(p.num_tokens for p in plans) == 10
    assert all(p.num_tokens <= 10 for p in plans)


def test_running_decodes_are_scheduled_before_new_prefills():
    h = Harness(num_blocks=32, max_num_batched_tokens=8)
    a = h.add("a", prompt_len=3, max_tokens=10)
    h.step()  # a's prefill
    assert a.num_output_tokens == 1
    b = h.add("b", prompt_len=20, max_tokens=2, first_token=300)
    plan = h.step()
    assert [c.seq_id for c in plan.chunks] == [a.seq_id, b.seq_id]
    assert len(plan.chunks[0].token_ids) == 1 and plan.chunks[0].sample
    assert len(plan.chunks[1].token_ids) == 7 and not plan.chunks[1].sample  # what is left of the budget
    # While b is still prefilling, a keeps decoding every step.
    while not b.num_output_tokens:
        plan = h.step()
        assert plan.chunks[0].seq_id == a.seq_id and len(plan.chunks[0].token_ids) == 1
    assert a.num_output_tokens >= 3


def test_max_num_seqs_caps_running_set():
    h = Harness(num_blocks=64, max_num_seqs=2)
    seqs = [h.add(f"r{i}", prompt_len=5, max_tokens=3, first_token=100 + 10 * i) for i in range(5)]
    plan = h.step()
    assert [c.seq_id for c in plan.chunks] == [seqs[0].seq_id, seqs[1].seq_id]
    assert len(h.sched.running) == 2 and list(h.sched.waiting) == seqs[2:]
    seen_running = 0
    while h.sched.has_work():
        h.step()
        seen_running = max(seen_running, len(h.sched.running))
        assert seen_running <= 2
    assert all(s.is_finished for s in seqs)


def test_out_of_blocks_preempts_latest_admitted_to_front_of_queue():
    # 4 blocks of 4 tokens; two 8-token prompts fill them, and the first decode step needs a 5th block.
    h = Harness(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    a = h.add("a", prompt_len=8, max_tokens=3, first_token=100)
    b = h.add("b", prompt_len=8, max_tokens=3, first_token=200)
    c = h.add("c", prompt_len=2, max_tokens=1, first_token=300)
    h.step()
    assert h.bm.num_free_blocks == 0
    assert [s.num_output_tokens for s in (a, b)] == [1, 1]
    assert h.sched.num_preemptions == 0

    plan = h.step()
    assert h.sched.num_preemptions == 1
    assert [ch.seq_id for ch in plan.chunks] == [a.seq_id]
    assert b.status is SequenceStatus.WAITING
    assert list(h.sched.waiting) == [b, c], "the preempted sequence goes back to the front of the queue"
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert h.sched.running == [a]
    assert len(a.block_table) == 3 and h.bm.num_free_blocks == 1
    # b keeps what it generated and will recompute prompt + output.
    assert b.num_tokens == 9

    h.run_to_completion()
    assert all(s.is_finished for s in (a, b, c))
    assert h.sched.num_preemptions >= 1


def test_state_slots_are_held_while_running_and_given_back_on_preemption_and_finish():
    h = Harness(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False, state_slots=True)
    a = h.add("a", prompt_len=8, max_tokens=3, first_token=100)
    b = h.add("b", prompt_len=8, max_tokens=3, first_token=200)
    c = h.add("c", prompt_len=2, max_tokens=1, first_token=300)
    plan = h.step()
    assert sorted(ch.state_slot for ch in plan.chunks) == [0, 1] and c.state_slot == -1
    assert h.sched.free_slots == []
    held_by_b = b.state_slot
    h.step()  # b preempted: it recomputes from position 0, so from an empty state in whatever slot it gets
    assert b.status is SequenceStatus.WAITING and b.state_slot == -1
    assert h.sched.free_slots == [held_by_b]
    h.run_to_completion()
    assert sorted(h.sched.free_slots) == [0, 1]
    assert all(s.state_slot == -1 for s in (a, b, c))


def test_without_state_slots_chunks_carry_none():
    h = Harness(num_blocks=8, state_slots=False)
    h.add("a", prompt_len=5)
    assert [ch.state_slot for ch in h.step().chunks] == [-1]
    assert h.sched.free_slots is None


def test_recomputed_sequence_resumes_from_its_generated_tokens():
    h = Harness(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    a = h.add("a", prompt_len=8, max_tokens=3, first_token=100)
    b = h.add("b", prompt_len=8, max_tokens=3, first_token=200)
    h.step()
    h.step()  # b preempted here
    assert b.status is SequenceStatus.WAITING
    tokens_before = list(b.token_ids)
    assert len(tokens_before) == 9
    while True:
        plan = h.step()
        mine = [ch for ch in plan.chunks if ch.seq_id == b.seq_id]
        if mine:
            break
    # Readmitted: it recomputes from position 0 its prompt and the token it had already generated,
    # and samples only after that, so no generated token is lost or repeated.
    assert (mine[0].start_position, mine[0].token_ids) == (0, tokens_before)
    assert mine[0].sample
    assert b.token_ids[:9] == tokens_before and b.num_output_tokens == 2
    h.run_to_completion()
    assert b.num_output_tokens == 3 and a.num_output_tokens == 3


def test_prefix_cache_hit_skips_cached_tokens_in_the_plan():
    h = Harness(num_blocks=32)
    a = h.add("a", prompt_len=13, max_tokens=1, first_token=100)
    h.step()
    assert a.is_finished
    b = h.add("b", prompt_len=13, max_tokens=1, first_token=100)
    plan = h.step()
    # The three full blocks of a's prompt are reused; only the last token is computed.
    assert (plan.chunks[0].start_position, len(plan.chunks[0].token_ids)) == (12, 1)
    assert h.bm.prefix_hits == 3
    assert b.is_finished
    assert h.bm.num_free_blocks == h.bm.num_blocks
