"""A CPU install may have no Triton (PyPI's CPU torch does not bring it, serving needs none, and the test extra
brings it on Linux x86-64 only): an engine on CPUs imports and generates without it, and gives the tokens it gives
with Triton installed."""

from __future__ import annotations

import json
import subprocess
import sys

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams

MODEL = "llama-untied"
PROMPT = [5, 17, 300, 42, 8]

# Run in a fresh interpreter where any import of triton fails, as on a machine without it.
WITHOUT_TRITON = """
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoTriton())
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams

with LLM(sys.argv[1], device="cpu", kv_cache_memory_gb=0.05) as llm:
    out = llm.generate([json.loads(sys.argv[2])], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps(out[0].token_ids))
"""


def test_a_cpu_engine_generates_without_triton(tiny_model_dir):
    path = tiny_model_dir(MODEL)
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, path, json.dumps(PROMPT)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with LLM(path, device="cpu", kv_cache_memory_gb=0.05) as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert json.loads(result.stdout.strip().splitlines()[-1]) == out[0].token_ids
