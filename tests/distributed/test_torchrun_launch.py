"""`shardserve serve` started by torchrun joins torchrun's group instead of starting its own ranks."""

from __future__ import annotations

import sys

import openai

from shardserve.distributed.process_group import find_free_port
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.serving import serve_cli

PROMPT = "w11 w22 w33 w44 w55"


def test_serve_under_torchrun_matches_single_rank(tiny_model_dir, set_env):
    set_env(SHARDSERVE_CONTROL_TOKEN="test-control-token")  # torchrun hands it to both ranks
    model_dir = tiny_model_dir("qwen3")
    with LLM(model_dir, kv_cache_memory_gb=0.05) as llm:
        expected = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    with serve_cli([model_dir, "-tp", "2", "--served-model-name", "tiny", "--kv-cache-memory", "0.05"],
                   launcher=torchrun) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    assert got == expected


def test_torchrun_world_size_must_match_tp(tiny_model_dir, tmp_path):
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "shardserve", "serve", tiny_model_dir("qwen3"), "-tp", "3", "--port", str(find_free_port())],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert ("torchrun started 2 ranks but --tensor-parallel-size x --pipeline-parallel-size is 3"
            in result.stdout + result.stderr)
