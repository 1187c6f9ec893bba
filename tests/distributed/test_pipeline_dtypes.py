"""Pipeline stages in a 16-bit dtype: the logits cross from the last stage to rank 0 in the dtype the LM head computes
them in (its own module: the engines here cannot live beside test_pipeline_parallel.py's, whose rank 0 shares the
test process)."""

from __future__ import annotations

import torch

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts

PROMPTS = random_prompts([1 + (13 * i) % 40 for i in range(6)], seed=77)


def test_bfloat16_stages_send_bfloat16_logits_and_give_the_tokens_of_one_rank(tiny_model_dir):
    """In bfloat16 the last stage sends the logits as its head computes them (half the bytes of float32), so rank 0
    samples from the same values as without stages: the same greedy tokens and logprobs."""
    model_dir = tiny_model_dir("qwen3-moe")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for pp in (1, 2):
        with LLM(model_dir, pipeline_parallel_size=pp, device="cpu", dtype="bfloat16", max_model_len=96,
                 max_num_seqs=16) as llm:
            if pp == 2:
                assert llm.engine.runner.pipe.logits_dtype == torch.bfloat16
            runs[pp] = [(tuple(o.token_ids), [(lp.token_id, lp.logprob) for lp in o.new_logprobs])
                        for o in llm.generate(PROMPTS, params)]
    assert runs[2] == runs[1]
