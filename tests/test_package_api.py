"""The offline API at the package top, as the README shows it, without making `import shardserve` heavy."""

from __future__ import annotations

import subprocess
import sys


def test_llm_and_sampling_params_come_from_the_package_top(tiny_model_dir):
    from shardserve import LLM, SamplingParams

    llm = LLM(tiny_model_dir("llama-tied"), kv_cache_memory_gb=0.05)
    try:
        out = llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 4 and out.finish_reason == "length"
    finally:
        llm.shutdown()


def test_importing_the_package_does_not_load_torch():
    code = "import sys, shardserve; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_an_unknown_name_is_an_attribute_error():
    import pytest

    import shardserve

    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        shardserve.Engine  # noqa: B018
