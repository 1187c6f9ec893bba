"""Several tensor-parallel engines, one after another, in one process (tests, scripts, a restarted rank 0):
each starts with the fast all-reduce and gives the same tokens. Before, the second one waited forever in
torch's symmetric-memory rendezvous (its counter per process differed between the old and the new ranks)."""

from __future__ import annotations

import pytest
import torch

from shardserve.distributed.all_reduce import IPC_ONE_SHOT
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams


@pytest.mark.gpu
def test_three_tensor_parallel_engines_in_one_process_start_and_agree(tiny_model_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens, methods = [], []
    for _ in range(3):
        with LLM(tiny_model_dir("llama-untied"), tensor_parallel_size=2, device="cuda", dtype="bfloat16",
                 kv_cache_memory_gb=0.05) as llm:
            tokens.append([out.token_ids for out in llm.generate([[5, 6, 7, 8], [9] * 20], params)])
            methods.append(llm.engine.runner.all_reduce_choice.describe())
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(IPC_ONE_SHOT in m for m in methods), methods
