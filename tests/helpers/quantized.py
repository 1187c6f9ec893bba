"""Quantized checkpoints written from a tiny model's float weights (FP8 with block or per-channel scales, 4-bit
GPTQ, NVFP4 and MXFP4), with a float checkpoint of the values they encode, for transformers to run as the reference."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0


def _quantize_fp8(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w / scale in float8_e4m3fn, and the value that encodes (scale broadcast against w)."""
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def fp8_block(w: torch.Tensor, block: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    amax = padded.abs().reshape(nr, block, nc, block).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    full = scale[:, None, :, None].expand(nr, block, nc, block).reshape(nr * block, nc * block)[:rows, :cols]
    q, value = _quantize_fp8(w, full)
    return {"weight": q, "weight_scale_inv": scale}, value


def fp8_channel(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q, value = _quantize_fp8(w, scale)
    return {"weight": q, "weight_scale": scale}, value


def pack_gptq_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 0..15 values per int32 along dim, value j in bits 4j..4j+3."""
    v = values.numpy().astype(np.uint32)
    v = v.reshape(-1, 8, v.shape[1]) if dim == 0 else v.reshape(v.shape[0], -1, 8)
    packed = np.zeros(v.shape[:1] + v.shape[2:] if dim == 0 else v.shape[:2], dtype=np.uint32)
    for j in range(8):
        packed |= (v[:, j, :] if dim == 0 else v[:, :, j]) << np.uint32(4 * j)
    return torch.from_numpy(packed.view(np.int32))


def gptq(w: torch.Tensor, group: int, sym: bool, act_order: bool, seed: int
         ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ's storage of w [N, K] (round to nearest; the checkpoint format is what matters here)."""
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    groups = -(-k // group)
    q = torch.empty(k, n, dtype=torch.int64)
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    value = torch.empty(n, k)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if sym:
            scale = (part.abs().amax(dim=1) / 7).clamp_min(1e-6).half()
            zero = torch.full((n,), 8, dtype=torch.int64)
        else:
            low, high = part.amin(dim=1).clamp(max=0), part.amax(dim=1).clamp(min=0)
            scale = ((high - low) / 15).clamp_min(1e-6).half()
            zero = (-low / scale.float()).round().clamp(0, 15).long()
        codes = (part / scale.float()[:, None]).round().long().add(zero[:, None]).clamp(0, 15)
        q[cols] = codes.t()
        scales[g], zeros[g] = scale, zero
        value[:, cols] = (codes - zero[:, None]).float() * scale.float()[:, None]
    tensors = {"qweight": pack_gptq_int4(q, 0), "qzeros": pack_gptq_int4(zeros - 1, 1), "scales": scales,
               "g_idx": g_idx}
    return tensors, value


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The e2m1 code (0..15) of the value nearest each element of x."""
    return (x.unsqueeze(-1) - E2M1).abs().argmin(dim=-1).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., C] -> [..., C / 2], column 2j in byte j's low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nvfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt's NVFP4 storage of w [N, K]: a global scale that puts the largest group scale at e4m3's largest
    value, each group of 16's scale (its absolute maximum over 6) rounded to e4m3, each weight to the nearest e2m1
    of it; and the values those encode (e2m1 times float32(e4m3 scale times global))."""
    n, k = w.shape
    groups = w.reshape(n, k // 16, 16)
    global_scale = (w.abs().max() / (6 * FP8_MAX)).clamp_min(1e-12).reshape(1)
    scale8 = (groups.abs().amax(dim=2) / 6 / global_scale).to(torch.float8_e4m3fn)
    scale = scale8.float() * global_scale
    codes = nearest_e2m1(groups / scale.clamp_min(1e-30)[:, :, None]).reshape(n, k)
    value = E2M1[codes.long()].reshape(n, k // 16, 16) * scale[:, :, None]
    tensors = {"weight": pack_nibbles(codes), "weight_scale": scale8, "weight_scale_2": global_scale,
               "input_scale": torch.ones(1)}
    return tensors, value.reshape(n, k)


def mxfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """MXFP4 storage of w [N, K] (a dense layer's `weight_blocks` [N, K / 32, 16] and e8m0 `weight_scales`): each
    group of 32's scale the power of two that puts its absolute maximum at or under 6; and the values encoded."""
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(dim=2).clamp_min(1e-30) / 6)).clamp(-127, 127)
    scale = torch.ldexp(torch.ones(exponent.shape), exponent.int())
    codes = nearest_e2m1(groups / scale[:, :, None])
    value = E2M1[codes.long()] * scale[:, :, None]
    tensors = {"weight_blocks": pack_nibbles(codes), "weight_scales": (exponent + 127).to(torch.uint8)}
    return tensors, value.reshape(n, k)


NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head"]}

SCHEMES = {
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [32, 32]},
                  lambda w, seed: fp8_block(w, 32)),
    "fp8-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                     "config_groups": {"group_0": {
                         "targets": ["Linear"],
                         "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                         "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                               "dynamic": True}}}},
                    lambda w, seed: fp8_channel(w)),
    "gptq-sym-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
                      "checkpoint_format": "gptq"},
                     lambda w, seed: gptq(w, 32, sym=True, act_order=False, seed=seed)),
    "gptq-asym-g128-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                                  "desc_act": True, "checkpoint_format": "gptq"},
                                 lambda w, seed: gptq(w, 128, sym=False, act_order=True, seed=seed)),
}

# The untied LM head quantized as well: GPTQModel's and AutoRound's `lm_head: true` (groups of 32 over its 128
# inputs), and a compressed-tensors FP8 checkpoint that does not ignore it (a scale per vocabulary row).
HEAD_SCHEMES = {"gptq-sym-g32-head": ({**SCHEMES["gptq-sym-g32"][0], "lm_head": True}, SCHEMES["gptq-sym-g32"][1]),
                "fp8-channel-head": ({**SCHEMES["fp8-channel"][0], "ignore": []}, SCHEMES["fp8-channel"][1])}


# 4-bit floats (e2m1): NVFP4 as ModelOpt writes it, MXFP4 in a dense layer's weight_blocks / weight_scales.
FP4_SCHEMES = {"nvfp4": (NVFP4_CONFIG, lambda w, seed: nvfp4(w)),
               "mxfp4": ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, lambda w, seed: mxfp4(w))}


def linear_weights(tensors: dict[str, torch.Tensor], head: bool = False) -> list[str]:
    return [n for n in tensors if n.startswith(("model.layers.", "backbone.layers.")) and n.endswith("_proj.weight")
            or head and n == "lm_head.weight"]


def write_quantized(source: str, scheme: str, root, keep: tuple[str, ...] = ()) -> tuple[str, str]:
    """The checkpoint at `source` with its attention and MLP (expert) projections (and LM head, for HEAD_SCHEMES)
    quantized by `scheme`, each layer's tensors spread over two files; and a float checkpoint of the values they
    encode. keep: module prefixes left in the checkpoint's dtype, named in the config's exclude_modules (as ModelOpt
    lists the layers it leaves alone)."""
    quant_config, quantize = {**SCHEMES, **HEAD_SCHEMES, **FP4_SCHEMES}[scheme]
    tensors = {}
    for name in os.listdir(source):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(source, name)))
    quant_dir, float_dir = root / "quantized", root / "float"
    for path in (quant_dir, float_dir):
        shutil.copytree(source, path)
        for name in os.listdir(path):
            if "safetensors" in name:
                os.remove(path / name)
    linear = [n for n in linear_weights(tensors, head=scheme in HEAD_SCHEMES) if not n.startswith(keep)]
    if keep:
        kept = sorted({n.removesuffix(".weight") for n in linear_weights(tensors) if n.startswith(keep)})
        quant_config = {**quant_config, "exclude_modules": [*quant_config.get("exclude_modules", []), *kept]}
    first, second, values = {}, {}, dict(tensors)
    for i, name in enumerate(linear):
        parts, values[name] = quantize(tensors[name], i)
        module = name.removesuffix(".weight")
        for j, (part, tensor) in enumerate(sorted(parts.items())):
            (first if j % 2 == 0 else second)[f"{module}.{part}"] = tensor.contiguous()
    first.update({n: t for n, t in tensors.items() if n not in linear})
    save_file(first, quant_dir / "model-00001-of-00002.safetensors")
    save_file(second, quant_dir / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (quant_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = quant_config
    (quant_dir / "config.json").write_text(json.dumps(config))
    save_file(values, float_dir / "model.safetensors")
    return str(quant_dir), str(float_dir)


def expert_blocks(llm) -> list:
    """The model's mixture-of-experts blocks (SparseMoE modules) on this rank."""
    return [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "SparseMoE"]
