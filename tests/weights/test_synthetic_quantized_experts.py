"""--load-format dummy on a quantized mixture of experts (how benchmarks run a model's real shapes): the experts
are packed as a real checkpoint's would be, each rank holding the synthetic experts quantized (a byte or half a
byte a weight), the same numbers at every tensor-parallel size."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from shardserve.layers.quantization.fp8 import quantize_fp8
from shardserve.layers.quantization.int4 import quantize_int4
from shardserve.kernels.quant_pack import dequantize_fp8, dequantize_int4
from shardserve.weights.synthetic import synthetic_tensor

SCHEMES = {
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32]}, torch.float8_e4m3fn),
    "gptq-int4": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                   "checkpoint_format": "gptq"}, torch.uint8),
}


def _quantized_config(source: str, target, scheme: str) -> str:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors*"))
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = SCHEMES[scheme][0]
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(target)


def _dequantized(kind: str, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if kind == "fp8":
        return dequantize_fp8(codes, scale, 32, torch.float32)
    return dequantize_int4(codes, scale, 32, torch.float32)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_dummy_weights_of_a_quantized_moe_keep_the_experts_packed(tiny_model_dir, tmp_path, set_env, scheme):
    from shardserve import LLM, SamplingParams

    set_env(SHARDSERVE_QUANTIZED_LAYERS="packed")  # on CPUs too
    model_dir = _quantized_config(tiny_model_dir("qwen3-moe-64"), tmp_path / scheme, scheme)
    kind = "fp8" if scheme == "fp8-block" else "int4"
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        with LLM(model_dir, tensor_parallel_size=tp, load_format="dummy", dtype="float32",
                 kv_cache_memory_gb=0.05) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate([[5, 6, 7], [40] * 9], greedy)]
            blocks = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "SparseMoE"]
            assert blocks and all(m.packed is not None for m in blocks)
            moe = blocks[0]
            assert moe.w13.dtype == SCHEMES[scheme][1]
            # Rank 0's rows of the synthetic gate/up tensor of layer 0, quantized as a packed layer's rows are.
            full = synthetic_tensor("model.layers.0.mlp.experts.gate_up_proj", (4, 128, 96), "cpu", torch.float32)
            (r0, r1), quantize = moe.rows, quantize_fp8 if kind == "fp8" else quantize_int4
            gate_rows = full[2, r0:r1]
            codes, scale = quantize(gate_rows, 32)
            expected = _dequantized(kind, codes, scale)
            held = _dequantized(kind, moe.w13.data[2, :r1 - r0], moe.w13_scale.data[2, :r1 - r0])
            assert torch.equal(held, expected)
            # Close to the synthetic values: within a step of the grid (4 bits) or FP8's relative precision.
            step = (gate_rows.abs().max() / 7) if kind == "int4" else gate_rows.abs().max() / 8
            assert (held - gate_rows).abs().max() <= step
    assert outputs[1] == outputs[2]
