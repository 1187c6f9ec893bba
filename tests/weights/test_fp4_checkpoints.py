"""4-bit float checkpoints (weights/fp4.py), built here from the tiny Llama's random weights: NVFP4 as ModelOpt
writes it (e2m1 codes two a byte, e4m3 scales per 16 columns, a float32 global scale, an activation scale that is
ignored) and MXFP4 in a dense layer's weight_blocks / weight_scales (e8m0 scales per 32). Served at TP 2, the greedy
tokens equal transformers float32 on the values the quantization encodes (computed while quantizing)."""

from __future__ import annotations

import json

import pytest
import torch

from shardserve.config import ModelConfig
from shardserve.weights.fp4 import Fp4Weight, mxfp4_group_scales, nvfp4_group_scales
from shardserve.weight_format import UnsupportedQuantization, parse_quantization
from tests.helpers.greedy import check_matches, reference
from tests.helpers.quantized import FP4_SCHEMES, NVFP4_CONFIG, mxfp4, nvfp4, write_quantized


@pytest.fixture(scope="module")
def fp4_dirs(tiny_model_dir, tmp_path_factory):
    """scheme -> (quantized checkpoint, float checkpoint of the encoded values), from llama-untied (o_proj's 64 and
    down_proj's 128 input columns a rank at TP 2: whole groups of 16 and 32)."""
    return {scheme: write_quantized(tiny_model_dir("llama-untied"), scheme, tmp_path_factory.mktemp(scheme))
            for scheme in FP4_SCHEMES}


def test_nvfp4_at_two_ranks_gives_transformers_tokens_on_the_encoded_values(fp4_dirs, tiny_model_dir):
    quant_dir, float_dir = fp4_dirs["nvfp4"]
    expected = reference(float_dir)
    assert expected != reference(tiny_model_dir("llama-untied"))  # the rounding changes the tokens
    check_matches(quant_dir, "llama-untied nvfp4", 2, device="cpu", expected=expected)


@pytest.mark.parametrize("quantize, scale_of", [
    (nvfp4, lambda t: nvfp4_group_scales(t["weight_scale"], t["weight_scale_2"])),
    (mxfp4, lambda t: mxfp4_group_scales(t["weight_scales"])),
])
def test_a_rank_slice_reads_the_encoded_values(quantize, scale_of):
    """Any row and column range (a column-parallel rank's rows, a row-parallel rank's columns, ranges starting inside
    a byte or a group) reads exactly the encoded values; read_packed gives whole groups' codes and scales."""
    tensors, value = quantize(torch.randn(24, 96))
    codes = tensors.get("weight", tensors.get("weight_blocks"))
    weight = Fp4Weight("w", codes.reshape(24, 48), scale_of(tensors), 96 // scale_of(tensors).shape[1])
    assert tuple(weight.get_shape()) == (24, 96)
    for rows, cols in ((slice(None), slice(None)), (slice(5, 17), slice(32, 64)), (slice(3, 4), slice(7, 61))):
        assert torch.equal(weight[rows, cols], value[rows, cols])
    group = weight.group
    packed_codes, scales = weight.read_packed(2, 9, group, 3 * group)
    assert packed_codes.shape == (7, 2 * group) and scales.shape == (7, 2)
    assert weight.packed_group(1, 1 + group) is None


def test_the_configs_name_the_schemes(tmp_path, tiny_model_dir):
    nvfp4_scheme = parse_quantization({"quantization_config": NVFP4_CONFIG})
    assert (nvfp4_scheme.method, nvfp4_scheme.group_columns, nvfp4_scheme.e2m1) == ("nvfp4", 16, True)
    mxfp4_scheme = parse_quantization({"quantization_config": FP4_SCHEMES["mxfp4"][0]})
    assert (mxfp4_scheme.method, mxfp4_scheme.group_columns) == ("mxfp4", 32)
    # Older ModelOpt exports keep the settings in hf_quant_config.json only.
    model_dir = tmp_path / "modelopt"
    import shutil

    shutil.copytree(tiny_model_dir("llama-tied"), model_dir)
    (model_dir / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.27.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head"]}}))
    assert ModelConfig.from_model_path(str(model_dir)).quantization == nvfp4_scheme


@pytest.mark.parametrize("change, named", [
    ({"quant_algo": "FP8"}, "modelopt quant_algo 'FP8' (NVFP4 only)"),
    ({"quant_algo": "W4A8_AWQ"}, "modelopt quant_algo 'W4A8_AWQ'"),
    ({"quant_algo": "MIXED_PRECISION"}, "modelopt quant_algo 'MIXED_PRECISION'"),
    ({"group_size": 32}, "NVFP4 with groups of 32"),
])
def test_other_modelopt_schemes_are_refused_naming_them(change, named):
    with pytest.raises(UnsupportedQuantization) as e:
        parse_quantization({"quantization_config": {**NVFP4_CONFIG, **change}})
    assert named in str(e.value) and "modelopt NVFP4 (weights only)" in str(e.value)



def _packed_generate(quant_dir: str) -> tuple[list[tuple[int, ...]], dict[str, str]]:
    """Greedy tokens at TP 2 with the quantized layers kept packed on CPU, and rank 0's packed layouts by module."""
    from shardserve import LLM, SamplingParams
    from tests.helpers.greedy import NEW_TOKENS, prompts

    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        layouts = {name: getattr(m.packed, "layout", m.packed).kind for name, m in
                   llm.engine.runner.model.named_modules() if getattr(m, "packed", None) is not None}
    return outputs, layouts


def test_packed_mxfp4_layers_at_two_ranks_give_transformers_tokens(fp4_dirs, set_env):
    """The packed "fp4" layout GPUs compute with (e2m1 codes, float32 group scales), kept packed on CPU where each
    product dequantizes: every projection is packed (o_proj and down_proj by whole groups of each rank's columns)
    and the tokens are transformers' on the encoded values."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = fp4_dirs["mxfp4"]
    outputs, layouts = _packed_generate(quant_dir)
    assert {name.split(".")[-1] for name in layouts} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert set(layouts.values()) == {"fp4"}
    assert outputs == list(reference(float_dir))


def test_packed_nvfp4_experts_at_two_ranks_give_transformers_tokens(tiny_model_dir, tmp_path, set_env):
    """Qwen3-MoE with its attention and every expert in NVFP4 (the router float): the experts load their rank's rows
    (w13) and columns (w2) into packed fp4 experts, each part with its own global scale folded into its rows'
    scales, and the tokens are transformers' on the encoded values."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = write_quantized(tiny_model_dir("qwen3-moe-64"), "nvfp4", tmp_path)
    outputs, layouts = _packed_generate(quant_dir)
    assert layouts["model.layers.0.mlp"] == "fp4" and layouts["model.layers.0.self_attn.qkv_proj"] == "fp4"
    assert outputs == list(reference(float_dir))
