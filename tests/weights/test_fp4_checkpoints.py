"""4-bit float checkpoints (weights/fp4.py), built here from the tiny Llama's random weights: NVFP4 as ModelOpt
writes it (e2m1 codes two a byte, e4m3 scales per 16 columns, a float32 global scale, an activation scale that is
ignored) and MXFP4 in a dense layer's weight_blocks / weight_scales (e8m0 scales per 32). Served at TP 2, the greedy
tokens equal transformers float32 on the values the quantization encodes (computed while quantizing). MXFP4's
e8m0 scales become the packed layout's e4m3 scales under a power-of-two row scale exactly, or are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from shardserve.config import ModelConfig
from shardserve.weights.fp4 import E4M3_POWERS, Fp4Weight, mxfp4_as_e4m3, mxfp4_group_scales, nvfp4_group_scales
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


def _nvfp4_scales(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's e4m3 group scales and its global scale as a row scale on every row."""
    scale = tensors["weight_scale"]
    return scale, tensors["weight_scale_2"].float().expand(scale.shape[0]).contiguous()


@pytest.mark.parametrize("quantize, scales_of, definition", [
    (nvfp4, _nvfp4_scales, lambda t: nvfp4_group_scales(t["weight_scale"], t["weight_scale_2"])),
    (mxfp4, lambda t: mxfp4_as_e4m3(t["weight_scales"]), lambda t: mxfp4_group_scales(t["weight_scales"])),
])
def test_a_rank_slice_reads_the_encoded_values(quantize, scales_of, definition):
    """Any row and column range (a column-parallel rank's rows, a row-parallel rank's columns, ranges starting inside
    a byte or a group) reads exactly the encoded values; read_packed gives whole groups' codes, e4m3 scales and
    row scales, whose float32 product is the format's group scale (its definition) exactly."""
    tensors, value = quantize(torch.randn(24, 96))
    codes = tensors.get("weight", tensors.get("weight_blocks"))
    scale, row_scale = scales_of(tensors)
    weight = Fp4Weight("w", codes.reshape(24, 48), scale, row_scale, 96 // scale.shape[1])
    assert tuple(weight.get_shape()) == (24, 96)
    for rows, cols in ((slice(None), slice(None)), (slice(5, 17), slice(32, 64)), (slice(3, 4), slice(7, 61))):
        assert torch.equal(weight[rows, cols], value[rows, cols])
    group = weight.group
    packed_codes, scales, row_scales = weight.read_packed(2, 9, group, 3 * group)
    assert packed_codes.shape == (7, 2 * group) and scales.shape == (7, 2) and row_scales.shape == (7,)
    assert (scales.dtype, row_scales.dtype) == (torch.float8_e4m3fn, torch.float32)
    assert torch.equal(scales.float() * row_scales[:, None], definition(tensors)[2:9, 1:3])
    assert weight.packed_group(1, 1 + group) is None
    with pytest.raises(ValueError, match="float8_e4m3fn group scales"):
        Fp4Weight("w", codes.reshape(24, 48), scale.float(), row_scale, group)


def test_mxfp4_scales_become_e4m3_under_a_power_of_two_row_scale_exactly():
    """mxfp4_as_e4m3: for every group, float32(e4m3 scale * row scale) is 2 ** (e - 127) exactly, on rows whose
    exponents span anything up to the 17 powers of two the e4m3 scales hold (2**-9 to 2**8), e8m0's extremes
    (2**-127, 2**127) included; a row spanning 18 is refused naming the tensor, while rows that span 17 each but 18
    together are not."""
    g = torch.Generator().manual_seed(0)
    spans = torch.randint(0, E4M3_POWERS, (16, 1), generator=g)  # 0 to 17
    base = torch.randint(0, 255 - E4M3_POWERS, (16, 1), generator=g)  # a row's top at most 253 (255: e8m0's NaN)
    offsets = torch.randint(0, 1 << 20, (16, 5), generator=g) % (spans + 1)
    offsets[:, 0], offsets[:, 1] = 0, spans[:, 0]  # each row reaches its span
    exponents = base + offsets
    exponents[0], exponents[1] = torch.tensor([0, 17, 5, 0, 17]), torch.tensor([237, 254, 254, 240, 250])
    exponents = exponents.to(torch.uint8)
    scale, row_scale = mxfp4_as_e4m3(exponents)
    assert (scale.dtype, tuple(scale.shape), row_scale.dtype, tuple(row_scale.shape)) == (
        torch.float8_e4m3fn, (16, 5), torch.float32, (16,))
    want = torch.ldexp(torch.ones(16, 5), exponents.int() - 127)
    assert torch.equal(want, mxfp4_group_scales(exponents))
    assert torch.equal(scale.float() * row_scale[:, None], want)
    assert (scale.float().amax(dim=1) == 2.0 ** 8).all()  # each row's largest at e4m3's largest power of two
    too_wide = torch.tensor([[100, 100 + E4M3_POWERS], [3, 4]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj_scales: .* span more"):
        mxfp4_as_e4m3(too_wide, "model.layers.0.mlp.experts.gate_up_proj_scales")
    each_narrow = torch.tensor([[100, 117], [101, 118]], dtype=torch.uint8)
    scale, row_scale = mxfp4_as_e4m3(each_narrow)
    assert torch.equal(scale.float() * row_scale[:, None], mxfp4_group_scales(each_narrow))


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


def test_modelopt_exclude_modules_name_the_16_bit_modules_by_name_parent_or_pattern():
    scheme = parse_quantization({"quantization_config": {**NVFP4_CONFIG, "exclude_modules": [
        "lm_head", "backbone.layers.4.mixer.in_proj", "backbone.layers.5.mixer", "*.conv1d*"]}})
    assert not scheme.quantizes("backbone.layers.4.mixer.in_proj")  # by name
    assert scheme.quantizes("backbone.layers.4.mixer.out_proj") and scheme.quantizes("backbone.layers.14.mixer.in_proj")
    assert not scheme.quantizes("backbone.layers.5.mixer.q_proj")  # inside a named module
    assert scheme.quantizes("backbone.layers.50.mixer.q_proj")
    assert not scheme.quantizes("backbone.layers.1.mixer.conv1d")  # a pattern
    assert "3 exclude_modules entries kept 16-bit" in scheme.describe()
    with pytest.raises(ValueError, match="exclude_modules must be a list of module names"):
        parse_quantization({"quantization_config": {**NVFP4_CONFIG, "exclude_modules": "lm_head"}})


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
    """The packed "fp4" layout GPUs compute with (e2m1 codes, e4m3 group scales under a power-of-two row scale),
    kept packed on CPU where each product dequantizes: every projection is packed (o_proj and down_proj by whole
    groups of each rank's columns) and the tokens are transformers' on the encoded values."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = fp4_dirs["mxfp4"]
    outputs, layouts = _packed_generate(quant_dir)
    assert {name.split(".")[-1] for name in layouts} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert set(layouts.values()) == {"fp4"}
    assert outputs == list(reference(float_dir))


def test_packed_nvfp4_experts_at_two_ranks_give_transformers_tokens(tiny_model_dir, tmp_path, set_env):
    """Qwen3-MoE with its attention and every expert in NVFP4 (the router float): the experts load their rank's rows
    (w13) and columns (w2) into packed fp4 experts, each part with its own global scale as its rows' row scales,
    and the tokens are transformers' on the encoded values."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = write_quantized(tiny_model_dir("qwen3-moe-64"), "nvfp4", tmp_path)
    outputs, layouts = _packed_generate(quant_dir)
    assert layouts["model.layers.0.mlp"] == "fp4" and layouts["model.layers.0.self_attn.qkv_proj"] == "fp4"
    assert outputs == list(reference(float_dir))
