"""--kv-cache-dtype fp8: greedy tokens at TP 1 and 2, prompts alone and batched, equal transformers' float32 ones
with keys and values rounded to e4m3 as the cache holds them (tests/helpers/fp8_kv.py says why that is the
reference), with the checkpoint's k_scale / v_scale where it ships them and 1.0 where not."""

from __future__ import annotations

import logging
import shutil

import pytest

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.fp8_kv import fp8_kv_greedy, write_kv_scales
from tests.helpers.greedy import NEW_TOKENS, prompts

# Qwen3's tiny model: head norms before the rotation, 6 query heads over 3 KV heads (split at TP 2). Its keys
# and values are about 1 in size: these scales put them into e4m3's coarse top range (steps of 16 to 32 around 200,
# saturating at 448 * scale), which no scale of 1.0 does. Layer 0's in compressed-tensors' names, layer 1's in
# ModelOpt's.
SCALES = ((0, 0.004, 0.006), (1, 0.005, 0.003))
SCALE_NAMES = {"model.layers.0.self_attn.k_scale": 0.004, "model.layers.0.self_attn.v_scale": 0.006,
               "model.layers.1.self_attn.k_proj.k_scale": 0.005, "model.layers.1.self_attn.v_proj.v_scale": 0.003}


@pytest.fixture(scope="module")
def scaled_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen3 checkpoint with KV scales added."""
    path = str(tmp_path_factory.mktemp("fp8-kv") / "qwen3-kv-scales")
    shutil.copytree(tiny_model_dir("qwen3"), path)
    write_kv_scales(path, SCALE_NAMES)
    return path


def _generate(model_dir: str, tp: int) -> tuple[list, list]:
    """Greedy tokens of every prompt batched together, then of the first two prompts alone."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=tp, device="cpu", dtype="float32", kv_cache_memory_gb=0.05,
             kv_cache_dtype="fp8") as llm:
        batched = [tuple(o.token_ids) for o in llm.generate(prompts(), params)]
        alone = [tuple(llm.generate([p], params)[0].token_ids) for p in prompts()[:2]]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return batched, alone


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_equal_the_reference_with_the_checkpoints_kv_scales(scaled_model_dir, tp):
    expected = fp8_kv_greedy(scaled_model_dir, tuple(map(tuple, prompts())), NEW_TOKENS, SCALES)
    # The scales matter: with 1.0 the same rounding reference answers otherwise.
    assert expected != fp8_kv_greedy(scaled_model_dir, tuple(map(tuple, prompts())), NEW_TOKENS)

    batched, alone = _generate(scaled_model_dir, tp)

    assert batched == list(expected), f"TP={tp}, batched"
    assert alone == list(expected[:2]), f"TP={tp}, alone"


def test_a_checkpoint_without_kv_scales_uses_one_and_says_so(tiny_model_dir, caplog):
    model_dir = tiny_model_dir("qwen3")
    expected = fp8_kv_greedy(model_dir, tuple(map(tuple, prompts())), NEW_TOKENS)

    with caplog.at_level(logging.INFO):
        batched, alone = _generate(model_dir, 1)

    assert batched == list(expected) and alone == list(expected[:2])
    assert "FP8 KV cache (e4m3): the checkpoint ships no k_scale / v_scale: 1.0 for all 2 attention layers" in caplog.text
    assert "of fp8_e4m3)" in caplog.text  # the KV cache's size line names its dtype
