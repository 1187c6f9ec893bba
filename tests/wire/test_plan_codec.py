"""Plans between ranks carry block tables as their changes; the other ranks rebuild exactly rank 0's plans."""

from __future__ import annotations

import random

import pytest

from shardserve.engine.block_manager import BlockManager
from shardserve.engine.scheduler import Scheduler
from shardserve.engine.sequence import Sequence
from shardserve.requests.sampling_params import SamplingParams
from shardserve.wire.step_plan import PlanDecoder, PlanEncoder, PlanKind, SeqChunk, StepPlan


def _same(a: StepPlan, b: StepPlan) -> bool:
    return a.encode() == b.encode()  # the whole form, as the lockstep digest sees it


@pytest.mark.parametrize("state_slots", [False, True])
def test_a_scheduled_run_with_preemptions_and_finishes_arrives_intact(state_slots):
    """Drive the real scheduler through prefill, decode, preemption (tables that change, not only grow) and
    finished sequences; every decoded plan equals the plan rank 0 made (with each chunk's recurrent-state slot
    where the model keeps one), and the decoder forgets finished ones."""
    rng = random.Random(3)
    blocks = BlockManager(num_blocks=24, block_size=4, enable_prefix_caching=not state_slots)
    scheduler = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=32, state_slots=state_slots)
    seqs = {}
    for i in range(10):
        seq = Sequence(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(3, 14))], SamplingParams(max_tokens=12))
        seqs[seq.seq_id] = seq
        scheduler.add(seq)
    encoder, decoder = PlanEncoder(), PlanDecoder()
    freed: list[int] = []
    whole_bytes = sent_bytes = 0
    for _ in range(200):
        if not scheduler.has_work():
            break
        plan = scheduler.schedule()
        plan.freed_seq_ids, freed = freed, []
        data = encoder.encode(plan)
        assert _same(decoder.decode(data), plan)
        assert all((c.state_slot >= 0) == state_slots for c in plan.chunks)
        whole_bytes, sent_bytes = whole_bytes + len(plan.encode()), sent_bytes + len(data)
        scheduler.finish_step(plan, seqs)
        for chunk in plan.chunks:
            seq = seqs[chunk.seq_id]
            if chunk.sample and seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(rng.randrange(50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.remove(seq)
                    freed.append(seq.seq_id)
    assert not scheduler.has_work() and scheduler.num_preemptions > 0, "the run must preempt and finish"
    plan = StepPlan(10_000, PlanKind.KEEPALIVE, freed_seq_ids=freed)
    assert _same(decoder.decode(encoder.encode(plan)), plan)
    assert decoder.known == encoder.known == {}, "finished sequences' tables are dropped on both sides"
    assert sent_bytes < whole_bytes


def test_a_decode_step_at_batch_512_sends_only_new_blocks():
    tables = {i: list(range(i * 48, i * 48 + 47)) for i in range(512)}
    encoder, decoder = PlanEncoder(), PlanDecoder()
    first = StepPlan(1, PlanKind.RUN, [SeqChunk(i, 740, [7], t, True) for i, t in tables.items()])
    decoder.decode(encoder.encode(first))
    for i in range(0, 512, 16):  # a sixteenth of the sequences cross into a new block
        tables[i] = tables[i] + [100_000 + i]
    step = StepPlan(2, PlanKind.RUN, [SeqChunk(i, 741, [-1], list(t), True) for i, t in tables.items()], [], 0, True)
    data = encoder.encode(step)
    assert _same(decoder.decode(data), step)
    assert len(data) < len(step.encode()) / 8


def test_a_plan_that_keeps_more_blocks_than_the_rank_has_is_refused():
    encoder, decoder = PlanEncoder(), PlanDecoder()
    encoder.encode(StepPlan(1, PlanKind.RUN, [SeqChunk(5, 0, [1, 2], [3, 4], True)]))  # the decoder missed it
    with pytest.raises(ValueError, match="keeps 2 blocks of sequence 5, this rank has 0"):
        decoder.decode(encoder.encode(StepPlan(2, PlanKind.RUN, [SeqChunk(5, 2, [9], [3, 4], True)])))
