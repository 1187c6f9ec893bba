"""The reference for an FP8 KV cache: transformers in float32 whose attention reads every key and value rounded to
e4m3 with its layer's scales, as shardserve's cache holds them.

Where the rounding goes: shardserve's cache stores keys after RoPE (and after Qwen3's head norms) and values as
projected, and every attention read, the step's own new tokens included, sees them as stored * scale
(attention/kv_quant.py). transformers hands its attention function exactly those tensors, post-RoPE keys and values
of the whole context (its own cache keeps them unrounded in float32; rounding them again at every step gives the same
values, so the result is as if the cache held the rounded ones). Queries stay unrounded in both. So rounding in a
registered attention function, then running torch SDPA, is the engine's arithmetic done by an independent model.
"""

from __future__ import annotations

import functools

import torch

from shardserve.attention import kv_quant
from tests.helpers.reference import one_torch_thread

ATTENTION = "fp8_kv_rounded_sdpa"


def _register(scales: dict[int, tuple[float, float]]) -> str:
    """An attention implementation rounding each layer's keys and values with scales[layer] ((1, 1) if absent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    name = f"{ATTENTION}_{abs(hash(tuple(sorted(scales.items()))))}"

    def rounded(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        key = kv_quant.round_like_cache(key, k_scale, kv_quant.FP8)
        value = kv_quant.round_like_cache(value, v_scale, kv_quant.FP8)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(name, rounded)
    return name


@functools.lru_cache(maxsize=None)
def fp8_kv_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], new_tokens: int,
                  scales: tuple[tuple[int, float, float], ...] = ()) -> tuple[tuple[int, ...], ...]:
    """transformers' float32 greedy continuation of each prompt alone, its keys and values rounded to e4m3 with
    `scales` ((layer, k_scale, v_scale) per layer; 1.0 where a layer is not named)."""
    from transformers import AutoModelForCausalLM

    attention = _register({layer: (k, v) for layer, k, v in scales})
    with one_torch_thread(), torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention)
        outputs = []
        for prompt in prompts:
            out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
            outputs.append(tuple(out[0, len(prompt):].tolist()))
    return tuple(outputs)


def write_kv_scales(model_dir: str, names_and_values: dict[str, float]) -> None:
    """Add the KV scale tensors (one float32 value each) to the checkpoint in model_dir, in a file of their own."""
    import json
    import os

    from safetensors.torch import save_file

    save_file({n: torch.tensor(v, dtype=torch.float32) for n, v in names_and_values.items()},
              os.path.join(model_dir, "kv_scales.safetensors"))
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update(dict.fromkeys(names_and_values, "kv_scales.safetensors"))
        with open(index, "w") as f:
            json.dump(data, f)
