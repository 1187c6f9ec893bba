"""Intel AutoRound INT4 checkpoints (`quant_method: auto-round`, GPTQ packing), built here from the tiny float
checkpoints: every projection in `model.layers` quantized to 4 bits in groups of 32 (round to nearest: the
format is what matters), the modules the config's extra_config keeps 16-bit stored as plain `weight`s (Qwen3-Next's
`in_proj_ba`, the routers and the shared-expert gates, named exactly or by a pattern as AutoRound writes them), the
LM head outside block_name_to_quantize. Served at TP 2, the greedy tokens equal transformers float32 on the values
the quantization encodes (a float checkpoint written from them while quantizing)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardserve import LLM, SamplingParams
from shardserve.weight_format import UnsupportedQuantization, parse_quantization
from shardserve.weights.quantized import unpack_int4
from tests.models.reference import random_prompts, transformers_greedy
from tests.helpers.quantized import gptq, pack_gptq_int4

NEW_TOKENS = 10
PROMPTS = random_prompts((5, 17, 40, 1))
GROUP = 32

# What AutoRound writes for a Qwen3-Next: the DeltaNet layers' in_proj_ba by name (a few outputs a rank), the
# routers by name, the shared-expert gates by a pattern (to_standard_regex's form of "shared_expert_gate").
QWEN3_NEXT_KEPT = {**{f"model.layers.{i}.linear_attn.in_proj_ba": {"bits": 16} for i in (0, 2)},
                   **{f"model.layers.{i}.mlp.gate": {"bits": 16, "data_type": "float"} for i in (0, 2, 3)},
                   r".*shared_expert_gate.*": {"bits": 16}}


def _config(packing: str, sym: bool, extra: dict) -> dict:
    return {"quant_method": "auto-round", "packing_format": packing, "bits": 4, "group_size": GROUP, "sym": sym,
            "data_type": "int", "iters": 0, "autoround_version": "0.9.0", "block_name_to_quantize": "model.layers",
            "extra_config": extra}


def _load(source: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, name)))
    return tensors


def write_autoround(source: str, root, quant_config: dict, g_idx: bool = True) -> tuple[str, str]:
    """The checkpoint at `source` with every 2-D weight the config quantizes stored in the config's GPTQ packing
    (the rest as it was), and a float checkpoint of the values they encode."""
    scheme = parse_quantization({"quantization_config": quant_config})
    tensors = _load(source)
    quant_dir, float_dir = root / "autoround", root / "float"
    for path in (quant_dir, float_dir):
        shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors*"))
    stored, values = {}, dict(tensors)
    linear = [n for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n]
    for i, name in enumerate(linear):
        module = name.removesuffix(".weight")
        if not scheme.quantizes(module):
            stored[name] = tensors[name]
            continue
        parts, values[name] = gptq(tensors[name], GROUP, sym=quant_config["sym"], act_order=False, seed=i)
        if scheme.zero_offset == 0:  # auto_round:gptqmodel: zero points as they are
            parts["qzeros"] = pack_gptq_int4(unpack_int4(parts["qzeros"], 1) + 1, 1)
        if not g_idx:
            del parts["g_idx"]
        stored.update({f"{module}.{part}": t.contiguous() for part, t in parts.items()})
    stored.update({n: t for n, t in tensors.items() if n not in linear})
    save_file(stored, quant_dir / "model.safetensors")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = quant_config
    (quant_dir / "config.json").write_text(json.dumps(config))
    save_file(values, float_dir / "model.safetensors")
    return str(quant_dir), str(float_dir)


def _generate(model_dir: str, tp: int) -> tuple[list[tuple[int, ...]], dict[str, bool]]:
    """Greedy tokens at `tp` ranks on CPU, and for each linear layer of rank 0 whether it is held packed."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=tp, device="cpu", dtype="float32", kv_cache_memory_gb=0.02,
             max_num_seqs=4) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(PROMPTS, greedy)]
        packed = {name: m.packed is not None for name, m in llm.engine.runner.model.named_modules()
                  if hasattr(m, "packed") and hasattr(m, "weight")}
    return outputs, packed


@pytest.fixture(scope="module")
def qwen3_next(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen3-Next in auto_round:auto_gptq, symmetric, without g_idx (groups from group_size)."""
    return write_autoround(tiny_model_dir("qwen3-next"), tmp_path_factory.mktemp("qwen3-next"),
                           _config("auto_round:auto_gptq", True, QWEN3_NEXT_KEPT), g_idx=False)


def test_the_kept_modules_are_stored_16_bit_and_the_rest_packed(qwen3_next):
    names = set(_load(qwen3_next[0]))
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "lm_head.weight" in names
    assert {"model.layers.0.linear_attn.in_proj_qkvz.qweight", "model.layers.0.mlp.experts.3.down_proj.qweight",
            "model.layers.1.self_attn.q_proj.qweight", "model.layers.3.mlp.shared_expert.gate_proj.qweight"} <= names
    assert not any(n.endswith("g_idx") for n in names)


def test_qwen3_next_at_two_ranks_gives_transformers_tokens_on_the_encoded_values(qwen3_next, tiny_model_dir):
    quant_dir, float_dir = qwen3_next
    expected = transformers_greedy(float_dir, tuple(map(tuple, PROMPTS)), NEW_TOKENS)
    assert expected != transformers_greedy(tiny_model_dir("qwen3-next"), tuple(map(tuple, PROMPTS)), NEW_TOKENS)
    outputs, _ = _generate(quant_dir, 2)
    assert outputs == list(expected)


def test_qwen3_next_packed_on_cpu_at_two_ranks(qwen3_next, set_env):
    """SHARDSERVE_QUANTIZED_LAYERS=packed: the interleaved in_proj_qkvz is read in its packed form a row range per
    key-head group (layers/deltanet_projections.load_interleaved), the 16-bit in_proj_ba, routers and shared-expert
    gates load as float layers, and the tokens stay transformers'."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = qwen3_next
    expected = transformers_greedy(float_dir, tuple(map(tuple, PROMPTS)), NEW_TOKENS)
    outputs, packed = _generate(quant_dir, 2)
    assert outputs == list(expected)
    for i in (0, 2):
        assert packed[f"model.layers.{i}.linear_attn.in_proj_qkvz"] and packed[f"model.layers.{i}.linear_attn.out_proj"]
        assert not packed[f"model.layers.{i}.linear_attn.in_proj_ba"]
    assert packed["model.layers.1.self_attn.qkv_proj"] and packed["model.layers.1.mlp.gate_up_proj"]
    assert not any(v for n, v in packed.items() if n.endswith(("mlp.gate", "shared_expert_gate", "lm_head")))


def test_llama_asymmetric_gptqmodel_packing_with_a_4_bit_lm_head(tiny_model_dir, tmp_path):
    """auto_round:gptqmodel stores the zero points as they are (not minus one); extra_config quantizes the head
    outside block_name_to_quantize."""
    config = _config("auto_round:gptqmodel", False, {"lm_head": {"bits": 4, "group_size": GROUP, "sym": False}})
    assert parse_quantization({"quantization_config": config}).lm_head
    quant_dir, float_dir = write_autoround(tiny_model_dir("llama-untied"), tmp_path, config)
    assert "lm_head.qweight" in _load(quant_dir)
    expected = transformers_greedy(float_dir, tuple(map(tuple, PROMPTS)), NEW_TOKENS)
    outputs, _ = _generate(quant_dir, 2)
    assert outputs == list(expected)


def test_the_config_names_the_scheme():
    scheme = parse_quantization({"quantization_config": _config("auto_round:auto_gptq", True, QWEN3_NEXT_KEPT)})
    assert (scheme.method, scheme.group_size, scheme.zero_offset, scheme.lm_head) == ("gptq", GROUP, 1, False)
    assert "auto-round" in scheme.describe() and "auto_round:auto_gptq" in scheme.describe()
    assert not scheme.quantizes("model.layers.2.linear_attn.in_proj_ba")
    assert not scheme.quantizes("model.layers.2.mlp.shared_expert_gate") and not scheme.quantizes("lm_head")
    assert scheme.quantizes("model.layers.2.linear_attn.in_proj_qkvz") and scheme.quantizes("model.layers.2.mlp.gate_up_proj")
    assert not scheme.quantizes("mtp.layers.0.self_attn.q_proj")  # outside block_name_to_quantize
    gptqmodel = parse_quantization({"quantization_config": {**_config("auto_round:gptqmodel", False, {}),
                                                            "quant_method": "intel/auto-round"}})
    assert gptqmodel.zero_offset == 0 and gptqmodel.quantizes("lm_head") is False
    unscoped = parse_quantization({"quantization_config": {**_config("auto_round:auto_gptq", True, {}),
                                                           "block_name_to_quantize": None}})
    assert unscoped.quantizes("mtp.layers.0.self_attn.q_proj") and not unscoped.quantizes("lm_head")


@pytest.mark.parametrize("change, named", [
    ({"packing_format": "auto_round:auto_awq"}, "packing_format 'auto_round:auto_awq'"),
    ({"packing_format": "auto_round:llm_compressor"}, "packing_format 'auto_round:llm_compressor'"),
    ({"bits": 8}, "auto-round with 8 bits"),
    ({"data_type": "nv_fp"}, "data_type 'nv_fp'"),
    ({"act_bits": 8}, "8-bit activations"),
    ({"extra_config": {"model.layers.0.mlp.down_proj": {"bits": 8}}}, "'model.layers.0.mlp.down_proj' with 8 bits"),
    ({"extra_config": {"model.layers.0.mlp.down_proj": {"group_size": 128}}}, "with groups of 128"),
])
def test_an_unsupported_auto_round_config_is_refused_naming_it(change, named):
    with pytest.raises(UnsupportedQuantization) as e:
        parse_quantization({"quantization_config": {**_config("auto_round:auto_gptq", True, {}), **change}})
    assert named in str(e.value) and "auto-round (4-bit int, GPTQ packing)" in str(e.value)


def test_a_module_the_config_keeps_16_bit_but_the_checkpoint_packs_is_refused(tiny_model_dir, tmp_path):
    """The config and the tensors must agree: in_proj_ba named 16-bit in extra_config but stored packed."""
    config = _config("auto_round:auto_gptq", True, QWEN3_NEXT_KEPT)
    routers = {k: v for k, v in QWEN3_NEXT_KEPT.items() if "in_proj_ba" not in k}
    quant_dir, _ = write_autoround(tiny_model_dir("qwen3-next"), tmp_path,
                                   _config("auto_round:auto_gptq", True, routers))
    path = os.path.join(quant_dir, "config.json")
    saved = json.loads(open(path).read())
    saved["quantization_config"] = config
    open(path, "w").write(json.dumps(saved))
    with pytest.raises(Exception, match=re.escape("model.layers.0.linear_attn.in_proj_ba.qweight")):
        LLM(quant_dir, device="cpu", dtype="float32", kv_cache_memory_gb=0.02)


def test_dummy_weights_keep_the_configs_16_bit_modules_float(qwen3_next, set_env):
    """--load-format dummy reads no tensors: which layers are packed comes from the config alone (in_proj_ba
    named in extra_config stays float; in_proj_qkvz, the attention and the experts are packed)."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    with LLM(qwen3_next[0], device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_num_seqs=4,
             load_format="dummy") as llm:
        model = llm.engine.runner.model
        packed = {name: m.packed is not None for name, m in model.named_modules() if hasattr(m, "packed")}
        assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids) == 2
    assert packed["model.layers.0.linear_attn.in_proj_qkvz"] and not packed["model.layers.0.linear_attn.in_proj_ba"]
    assert packed["model.layers.1.self_attn.qkv_proj"] and packed["model.layers.0.mlp"]
    assert not packed["lm_head"]


def test_qwen3_5_moe_packed_at_two_ranks_computes_the_shared_expert_among_the_experts(tiny_model_dir, tmp_path,
                                                                                     set_env):
    """Qwen3.5-MoE's shared expert has its experts' size: held packed, it becomes the last of each block's packed
    experts and its gate the router's last row (layers/moe_shared.py), and the tokens stay transformers' on the
    encoded values."""
    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    kept = {**{f"model.layers.{i}.mlp.gate": {"bits": 16} for i in range(4)}, r".*shared_expert_gate.*": {"bits": 16},
            **{f"model.layers.{i}.linear_attn.in_proj_{p}": {"bits": 16} for i in (0, 2) for p in "ab"}}
    quant_dir, float_dir = write_autoround(tiny_model_dir("qwen3.5-moe"), tmp_path,
                                           _config("auto_round:auto_gptq", False, kept))
    expected = transformers_greedy(float_dir, tuple(map(tuple, PROMPTS)), NEW_TOKENS)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=2, device="cpu", dtype="float32", kv_cache_memory_gb=0.02,
             max_num_seqs=4) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(PROMPTS, greedy)]
        blocks = [m for m in llm.engine.runner.model.modules() if hasattr(m, "shared_folded")]
    assert outputs == list(expected)
    assert len(blocks) == 4
    for moe in blocks:
        assert moe.shared_folded and moe.shared_expert is None and moe.packed is not None
        assert moe.w13.shape[0] == 5 and moe.gate.output_size == 5  # 4 experts and the shared one
