"""A rank that executes a different step than rank 0 planned stops the engine at that step, on every
rank, with a message naming the step and the rank; ranks that agree run on."""

from __future__ import annotations

import torch

from shardserve.config import EngineConfig
from shardserve.distributed.process_group import destroy_rank_context, init_rank_context
from tests.ranks import run_ranks

DIVERGE_AT = 3  # step 1 prefills, steps 2... decode


def _rank(rank: int, port: int, model_dir: str, diverge: bool, results) -> None:
    torch.set_num_threads(1)
    if rank == 1 and diverge:
        import shardserve.distributed.control_plane as control_plane

        receive = control_plane.ControlPlane.receive

        def receive_then_corrupt(self):
            plan = receive(self)
            if plan.step_id == DIVERGE_AT:
                plan.chunks[0].token_ids = [plan.chunks[0].token_ids[0] + 1]  # a bit flipped on the way
            return plan

        control_plane.ControlPlane.receive = receive_then_corrupt
    config = EngineConfig(model=model_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=0.02)
    ctx = init_rank_context(rank, 2, "cpu", f"tcp://127.0.0.1:{port}", config=config, control_token="test-token")
    try:
        if rank == 0:
            from shardserve.engine.llm_engine import LLMEngine
            from shardserve.requests.sampling_params import SamplingParams
            from shardserve.tokenizer import Tokenizer

            engine = LLMEngine(config, ctx, Tokenizer.from_model_path(model_dir))
            engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            steps = 0
            while engine.has_work():
                engine.step()
                steps += 1
            engine.shutdown()
            results.put((rank, f"finished after {steps} steps, {engine.lockstep.checked} checked"))
        else:
            from shardserve.engine.llm_engine import run_worker

            run_worker(config, ctx)
            results.put((rank, "finished"))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        destroy_rank_context(ctx, timeout_s=5)


def test_a_diverging_rank_is_named_at_the_step_it_diverged(tiny_model_dir):
    outcome = run_ranks(_rank, 2, tiny_model_dir("llama-untied"), True)
    for rank in (0, 1):
        assert outcome[rank] == (f"LockstepError: ranks out of step at step {DIVERGE_AT}: rank 1 differs in plan "
                                 "digest. The server stops rather than compute with ranks that disagree."), outcome


def test_ranks_in_step_check_every_step_on_cpu(tiny_model_dir):
    outcome = run_ranks(_rank, 2, tiny_model_dir("llama-untied"), False)
    assert outcome == {0: "finished after 6 steps, 6 checked", 1: "finished"}
