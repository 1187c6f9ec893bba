"""Quantized checkpoints, built here by quantizing a tiny Llama's random weights: FP8 with block scales
(DeepSeek-V3 / Qwen3-FP8 layout), FP8 per channel (compressed-tensors), 4-bit GPTQ symmetric with groups of 32
and asymmetric with groups of 128 in activation order (a g_idx that permutes). Served at TP 1, 2 and 4, the
greedy tokens equal transformers float32 on the values the quantization encodes (computed here, while
quantizing, not by unpacking). A quantized layer's tensors are written to two different files, as sharded
checkpoints may. Unsupported methods stop start-up with one line naming them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardserve.config import ModelConfig
from shardserve.weight_format import UnsupportedQuantization, parse_quantization
from tests.helpers.greedy import NEW_TOKENS, check_matches, prompts, reference
from tests.helpers.quantized import HEAD_SCHEMES, SCHEMES, expert_blocks, fp8_channel, linear_weights, write_quantized


@pytest.fixture(scope="module")
def quantized_dirs(tiny_model_dir, tmp_path_factory):
    """scheme -> (quantized checkpoint, float checkpoint of the encoded values), from llama-untied (8 heads of
    16 over 2 KV heads, 256 MLP features: groups of 32 and 128 both divide its input widths)."""
    return {scheme: write_quantized(tiny_model_dir("llama-untied"), scheme, tmp_path_factory.mktemp(scheme))
            for scheme in (*SCHEMES, *HEAD_SCHEMES)}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_quantized_checkpoints_give_transformers_tokens_on_the_encoded_values(quantized_dirs, scheme, tp):
    quant_dir, float_dir = quantized_dirs[scheme]
    check_matches(quant_dir, f"llama-untied {scheme}", tp, device="cpu", expected=reference(float_dir))


@pytest.mark.parametrize("scheme", ["fp8-block", "gptq-sym-g32"])
def test_a_quantized_mixture_of_experts_at_two_ranks_and_with_expert_parallelism(quantized_model_dir, scheme):
    """Qwen3-MoE with every expert's projections quantized (the router stays float, as in Qwen3-30B-A3B-FP8)."""
    from shardserve import LLM, SamplingParams

    quant_dir, float_dir = quantized_model_dir("qwen3-moe", scheme)
    expected = reference(float_dir)
    check_matches(quant_dir, f"qwen3-moe {scheme}", 2, device="cpu", expected=expected)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=0.05,
             enable_expert_parallel=True) as llm:
        assert [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)] == list(expected)


def test_the_encoded_values_differ_from_the_float_weights(quantized_dirs, tiny_model_dir):
    """The reference above is not the unquantized model: a loader that read the float weights would fail."""
    quant_dir, float_dir = quantized_dirs["gptq-asym-g128-act-order"]
    assert reference(float_dir) != reference(tiny_model_dir("llama-untied"))


def test_the_config_names_the_scheme():
    scheme = parse_quantization({"quantization_config": SCHEMES["fp8-block"][0]})
    assert (scheme.method, scheme.weight_block) == ("fp8", (32, 32))
    scheme = parse_quantization({"quantization_config": SCHEMES["gptq-sym-g32"][0]})
    assert (scheme.method, scheme.group_size, scheme.zero_offset) == ("gptq", 32, 1)
    assert parse_quantization({}) is None


@pytest.mark.parametrize("quant_config, named", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "gptq", "bits": 8}, "gptq with 8 bits"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "modelopt quant_algo 'FP8'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "'pack-quantized'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
])
def test_an_unsupported_method_is_refused_naming_it_and_the_supported_ones(quant_config, named):
    with pytest.raises(UnsupportedQuantization) as e:
        parse_quantization({"quantization_config": quant_config})
    message = str(e.value)
    assert named in message and "gptq (4-bit)" in message and "fp8" in message and "\n" not in message


def test_serve_stops_with_one_line_for_an_unsupported_method(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "awq"
    shutil.copytree(tiny_model_dir("llama-tied"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization):
        ModelConfig.from_model_path(str(model_dir))
    from tests.serving import find_free_port

    run = subprocess.run([sys.executable, "-m", "shardserve", "serve", str(model_dir), "--port", str(find_free_port())],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "quantization method 'awq'" in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_a_symmetric_gptq_checkpoint_decodes_from_4_bit_blocks_on_cpu(quantized_dirs, tp, set_env):
    """blockq-decode (forced, whatever this CPU would pick) finds each rank's GPTQ groups again as Q4_0 blocks:
    every quantized layer keeps a 4-bit copy for decode steps, and the tokens stay transformers'."""
    from shardserve import LLM, SamplingParams
    from shardserve.layers.linear import KernelLinear
    from shardserve.layers.linear_kernels import build_linear_kernel

    if build_linear_kernel("blockq-decode")[0] is None:
        pytest.skip(build_linear_kernel("blockq-decode")[1])
    set_env(SHARDSERVE_LINEAR_KERNEL="blockq-decode")
    quant_dir, float_dir = quantized_dirs["gptq-sym-g32"]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        layers = [m for name, m in llm.engine.runner.model.named_modules()
                  if isinstance(m, KernelLinear) and ".layers." in f".{name}"]
        compact = [len(m.prepared) == 4 for m in layers]  # the float32 form, then q, d, m
    assert layers and all(compact), f"{compact.count(False)} of {len(layers)} layers kept no 4-bit copy"
    assert outputs == list(reference(float_dir))


@pytest.mark.parametrize("scheme, tp", [(s, 2) for s in sorted(SCHEMES)] + [("fp8-block", 4), ("gptq-sym-g32", 4),
                                                                          ("gptq-asym-g128-act-order", 1)])
def test_packed_quantized_layers_give_transformers_tokens(quantized_dirs, scheme, tp, set_env):
    """The packed form GPUs compute with (layers/quantization/packed.py: FP8 bytes and scales, 4-bit codes, zero points
    and act order's column order, sliced per rank), kept packed here on CPU, where each product dequantizes: the
    tokens are transformers' on the encoded values. An act-order layer split by columns (TP > 1) stays unpacked."""
    from shardserve import LLM, SamplingParams

    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = quantized_dirs[scheme]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        packed = {name.split(".")[-1]: type(m.packed).__name__ for name, m in llm.engine.runner.model.named_modules()
                  if getattr(m, "packed", None) is not None}
    unsplit = ["qkv_proj", "gate_up_proj"]
    split = [] if scheme.endswith("act-order") and tp > 1 else ["o_proj", "down_proj"]
    assert sorted(packed) == sorted(unsplit + split)
    assert outputs == list(reference(float_dir))


@pytest.mark.parametrize("scheme, tp, layers", [("gptq-sym-g32-head", 2, "auto"), ("gptq-sym-g32-head", 3, "packed"),
                                               ("fp8-channel-head", 2, "packed")])
def test_a_checkpoint_with_a_quantized_lm_head(quantized_dirs, set_env, scheme, tp, layers):
    """GPTQ's `lm_head: true` (or an FP8 checkpoint whose head is not ignored): the head's packed tensors load like a
    projection's, by vocabulary rows (at TP 3 the last rank's 334 rows hold the vocabulary's last 332), read as the
    values they encode (CPU default) or kept packed. The tokens are transformers' on the encoded values, not those
    of the head left float."""
    from shardserve import LLM, SamplingParams

    set_env(SHARDSERVE_QUANTIZED_LAYERS=layers)
    quant_dir, float_dir = quantized_dirs[scheme]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        head = llm.engine.runner.model.lm_head
        held = (head.packed is not None, head.weight.dtype, tuple(head.weight.shape))
    rows = -(-1000 // tp)
    packed = (True, torch.uint8, (rows, 64)) if scheme.startswith("gptq") else (True, torch.float8_e4m3fn, (rows, 128))
    assert held == packed if layers == "packed" else not held[0]
    assert outputs == list(reference(float_dir))
    if layers == "packed":  # against the same scheme with the head left float
        assert reference(float_dir) != reference(quantized_dirs[scheme.removesuffix("-head")][1])


def test_a_packed_lm_head_keeps_zeros_past_the_vocabulary():
    """The last of 3 ranks holds 334 head rows for the vocabulary's last 332 words: its 2 padding rows get zero codes
    and zero scales (logits of 0, cut off after the gather), whatever the memory held before loading."""
    from types import SimpleNamespace

    from shardserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from shardserve.layers.linear import deferred_weights
    from shardserve.layers.quantization.packed import PackedLayout, PackedWeights

    comm = SimpleNamespace(rank=2, world_size=3)
    with deferred_weights():
        head = ParallelLMHead(VocabParallelEmbedding(1000, 64, torch.float32, comm), tied=False)
    head.packed = PackedWeights(head, PackedLayout("int4", 32), "cpu")
    head.weight.data.fill_(0x77)
    head.weight_scale.data.fill_(-1)
    values = torch.randn(1000, 64)
    head.weight.weight_loader(head.weight, values)
    weight = head.packed.dequantized(head, torch.float32)
    assert weight.shape == (334, 64) and not weight[332:].any()
    assert torch.allclose(weight[:332], values[668:], atol=0.3)


def test_a_quantized_lm_head_tied_to_the_embedding_is_refused():
    config = {"quantization_config": HEAD_SCHEMES["gptq-sym-g32-head"][0], "tie_word_embeddings": True}
    with pytest.raises(UnsupportedQuantization, match="lm_head: true with tie_word_embeddings"):
        parse_quantization(config)
    scheme = parse_quantization({**config, "tie_word_embeddings": False})
    assert scheme.lm_head and "the LM head too" in scheme.describe()
    assert not parse_quantization({"quantization_config": SCHEMES["gptq-sym-g32"][0]}).lm_head


def test_plan_counts_a_quantized_lm_head_packed():
    """A GPTQ Llama-3-8B with `lm_head: true`: the head's 128,256 x 4,096 weights at 0.53 bytes rather than 2."""
    from shardserve.planner import PlanRequest, plan
    from tests.helpers.configs import LLAMA3_8B

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    plans = [plan({**LLAMA3_8B, "quantization_config": {**gptq, "lm_head": head}},
                  PlanRequest(tensor_parallel_size=2, gpu_memory_gb=80)) for head in (False, True)]
    head_rows = 128256 // 2 * 4096
    assert plans[0].weight_bytes - plans[1].weight_bytes == pytest.approx(head_rows * (2 - 0.5 - 4 / 128), rel=1e-6)
    assert any("and the LM head" in w for w in plans[1].warnings) and not any(
        "LM head" in w for w in plans[0].warnings)


@pytest.mark.parametrize("ignore, targets, tied, quantized", [
    (["lm_head"], ["Linear"], False, False), ([], ["Linear"], False, True), (["re:.*lm_head"], ["Linear"], False, False),
    ([], ["re:.*_proj$"], False, False), ([], ["re:.*_proj$", "lm_head"], False, True), ([], ["Linear"], True, False)])
def test_a_compressed_tensors_config_says_whether_its_lm_head_is_quantized(ignore, targets, tied, quantized):
    """The head is quantized where a config group targets it and `ignore` does not name it (and it is not the tied
    embedding); the planner then counts it at a byte a weight, as start-up keeps it, and says so."""
    from shardserve.planner import PlanRequest, plan
    from tests.helpers.configs import LLAMA3_8B

    fp8 = {**SCHEMES["fp8-channel"][0], "ignore": ignore}
    fp8["config_groups"] = {"group_0": {**fp8["config_groups"]["group_0"], "targets": targets}}
    scheme = parse_quantization({"quantization_config": fp8, "tie_word_embeddings": tied})
    assert scheme.lm_head is quantized and ("the LM head too" in scheme.describe()) is quantized
    if tied:
        return
    plans = [plan({**LLAMA3_8B, "quantization_config": config}, PlanRequest(tensor_parallel_size=2, gpu_memory_gb=80))
             for config in (SCHEMES["fp8-channel"][0], fp8)]
    assert plans[0].weight_bytes - plans[1].weight_bytes == (128256 // 2 * 4096 if quantized else 0)
    assert any("and the LM head" in w for w in plans[1].warnings) is quantized


def _fp8_rows(w: torch.Tensor, parts: int) -> torch.Tensor:
    """w's values as FP8 with a scale per row of each of `parts` column slices (a row-parallel layer's ranks)."""
    return torch.cat([fp8_channel(chunk)[1] for chunk in w.chunk(parts, dim=1)], dim=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_quantization_fp8_rounds_a_float_checkpoint_at_load(tiny_model_dir, tmp_path, tp):
    """--quantization fp8: every projection stored as FP8 with a scale per output row of the rank's slice; on CPU
    the engine computes with those values, so the tokens are transformers' on them."""
    source = tiny_model_dir("llama-untied")
    tensors = {}
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, name)))
    float_dir = tmp_path / "fp8-values"
    shutil.copytree(source, float_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    row_parallel = ("o_proj.weight", "down_proj.weight")
    values = {n: _fp8_rows(t, tp if n.endswith(row_parallel) else 1) if n in linear_weights(tensors) else t
              for n, t in tensors.items()}
    save_file(values, float_dir / "model.safetensors")
    from shardserve import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(source, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_gb=0.05, quantization="fp8") as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        assert "fp8" in llm.engine.runner.plan.quantized
    assert outputs == list(reference(str(float_dir)))
    assert reference(str(float_dir)) != reference(source)


def test_quantization_fp8_refuses_a_quantized_checkpoint(quantized_dirs):
    from shardserve import LLM

    with pytest.raises(Exception, match="already quantized"):
        LLM(quantized_dirs["gptq-sym-g32"][0], dtype="float32", kv_cache_memory_gb=0.05, quantization="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", sorted(SCHEMES) + sorted(HEAD_SCHEMES))
def test_packed_quantized_layers_on_a_gpu(quantized_dirs, scheme):
    """On CUDA the layers stay packed by default and run the GPU kernels (float32 activations: the single-row
    GEMVs and dequantize + matmul): transformers' tokens on the encoded values, at one rank and at two."""
    from shardserve import LLM, SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    quant_dir, float_dir = quantized_dirs[scheme]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for tp in [1, 2] if torch.cuda.device_count() >= 2 else [1]:
        with LLM(quant_dir, tensor_parallel_size=tp, device="cuda", dtype="float32", kv_cache_memory_gb=0.05) as llm:
            outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
            assert "packed on" in llm.engine.runner.plan.quantized, llm.engine.runner.plan.quantized
            assert (llm.engine.runner.model.lm_head.packed is not None) == (scheme in HEAD_SCHEMES)
        assert outputs == list(reference(float_dir)), f"{scheme} TP={tp}"


def test_an_unknown_online_quantization_is_refused_naming_the_accepted_one():
    from shardserve.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of None, fp8, got 'int8'"):
        EngineConfig(model="m", quantization="int8")
    run = subprocess.run([sys.executable, "-m", "shardserve", "serve", "m", "--quantization", "int8"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--quantization: invalid choice: 'int8'" in run.stderr and "'fp8'" in run.stderr


def test_plan_counts_fp8_at_load(tmp_path):
    """shardserve plan --quantization fp8: the projections at a byte a weight, named in a warning."""
    from tests.helpers.configs import LLAMA3_8B

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    plans = [json.loads(subprocess.run([sys.executable, "-m", "shardserve", "plan", str(config), "--gpu-memory-gb",
                                        "80", "--json", *extra], capture_output=True, text=True, timeout=60).stdout)
             for extra in ([], ["--quantization", "fp8"])]
    assert plans[1]["weight_bytes"] < 0.6 * plans[0]["weight_bytes"]
    assert any("fp8 at load" in w for w in plans[1]["warnings"])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("scheme", ["fp8-block", "gptq-sym-g32"])
def test_packed_experts_give_transformers_tokens(quantized_model_dir, set_env, scheme, tp):
    """A quantized Qwen3-MoE whose experts stay packed (SHARDSERVE_QUANTIZED_LAYERS=packed on CPU: each call
    dequantizes the chosen experts): a byte (FP8) or half a byte (4-bit) a weight on each rank, and transformers'
    tokens on the encoded values."""
    from shardserve import LLM, SamplingParams

    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = quantized_model_dir("qwen3-moe-64", scheme)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=tp, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        blocks = expert_blocks(llm)
        weights_held = 2 * 4 * (64 // tp) * 96  # w13's weights on a rank: 4 experts, gate and up rows, H = 96
        held = [(m.packed is not None, m.w13.dtype, m.w13.element_size() * m.w13.numel() / weights_held)
                for m in blocks]
    want_dtype, bytes_per_weight = (torch.float8_e4m3fn, 1.0) if scheme.startswith("fp8") else (torch.uint8, 0.5)
    assert blocks and held == [(True, want_dtype, bytes_per_weight)] * len(blocks)
    assert outputs == list(reference(float_dir))


def test_experts_whose_slice_splits_a_scale_group_stay_dequantized(quantized_model_dir, set_env):
    """48 expert features in two ranks of 24 split FP8's blocks of 32: the experts are held dequantized (logged) and
    the tokens stay transformers'."""
    from shardserve import LLM, SamplingParams

    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    quant_dir, float_dir = quantized_model_dir("qwen3-moe", "fp8-block")
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(quant_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=0.05) as llm:
        outputs = [tuple(o.token_ids) for o in llm.generate(prompts(), greedy)]
        blocks = expert_blocks(llm)
        assert blocks and all(m.packed is None and m.w13.dtype == torch.float32 for m in blocks)
    assert outputs == list(reference(float_dir))


MODULE_NAMES = ["lm_head", "model.layers.0.linear_attn.in_proj_ba", "model.layers.10.linear_attn.in_proj_ba",
                "model.layers.3.mlp.gate", "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.shared_expert_gate",
                "model.layers.3.mlp.shared_expert.gate_proj", "model.layers.3.self_attn.q_proj", "layers.1.attn",
                "layers.11.attn", "model.layers.3.mlp.experts.0.down_proj"]


def test_modules_to_not_convert_are_matched_as_transformers_matches_them():
    """An FP8 (or MXFP4) config's modules_to_not_convert (Qwen's FP8 releases name in_proj_ba and the gates there):
    a module is kept 16-bit exactly where transformers' should_convert_module says so: a regular expression from
    the start of the name up to a module boundary, or a suffix."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    kept = ["lm_head", "model.layers.0.linear_attn.in_proj_ba", "mlp.gate", "shared_expert_gate",
            "model.layers.*.self_attn", r"layers\.1"]
    for config in (SCHEMES["fp8-block"][0], {"quant_method": "mxfp4"}):
        scheme = parse_quantization({"quantization_config": {**config, "modules_to_not_convert": kept}})
        answers = [scheme.quantizes(name) for name in MODULE_NAMES]
        assert answers == [should_convert_module(name, kept) for name in MODULE_NAMES]
        assert True in answers and False in answers
    with pytest.raises(ValueError, match="modules_to_not_convert must be a list"):
        parse_quantization({"quantization_config": {**SCHEMES["fp8-block"][0], "modules_to_not_convert": "lm_head"}})
    with pytest.raises(ValueError, match=r"entry '\*\.gate' is not a regular expression"):
        parse_quantization({"quantization_config": {**SCHEMES["fp8-block"][0], "modules_to_not_convert": ["*.gate"]}})


def test_dummy_weights_of_an_fp8_config_keep_its_modules_to_not_convert_16_bit(tiny_model_dir, tmp_path, set_env):
    """--load-format dummy reads no tensors: an FP8 Qwen3-Next config that keeps in_proj_ba and the gates 16-bit
    (as Qwen's FP8 releases do) leaves them so, and packs in_proj_qkvz, attention and the experts."""
    from shardserve import LLM, SamplingParams

    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")
    model_dir = tmp_path / "qwen3-next-fp8"
    shutil.copytree(tiny_model_dir("qwen3-next"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    kept = ["lm_head", *(f"model.layers.{i}.linear_attn.in_proj_ba" for i in range(layers)), "mlp.gate",
            "mlp.shared_expert_gate"]
    config["quantization_config"] = {**SCHEMES["fp8-block"][0], "modules_to_not_convert": kept}
    (model_dir / "config.json").write_text(json.dumps(config))
    with LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_num_seqs=4,
             load_format="dummy") as llm:
        packed = {name: m.packed is not None for name, m in llm.engine.runner.model.named_modules()
                  if hasattr(m, "packed")}
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids) == 2
    assert packed["model.layers.0.linear_attn.in_proj_qkvz"] and not packed["model.layers.0.linear_attn.in_proj_ba"]
    assert packed["model.layers.1.self_attn.qkv_proj"] and packed["model.layers.0.mlp"]
