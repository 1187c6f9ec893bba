"""How keys and values are stored in the paged cache: in the compute dtype, in bfloat16, or in FP8 (e4m3) with a
scale per layer for the keys and one for the values (`--kv-cache-dtype`, vLLM's names).

Invariant of an FP8 cache: the slot of value x holds e4m3(clamp(x / scale, -448, 448)), rounded to nearest even, and
every reader takes it as stored * scale, in float32 or folded into a float32 product (the Triton kernels multiply
the scores by the key scale and the output by the value scale). Attention never sees a key or value that the cache
does not hold, so a step reads its own new tokens as later steps will.

The scales come from the checkpoint (FP8 checkpoints ship them as `k_scale` / `v_scale` tensors under each attention
block) or are 1.0.
"""

from __future__ import annotations

import re

import torch

from shardserve.kv_cache_dtype import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value: quantized values saturate here instead of overflowing to NaN

# Checkpoint names of the KV scales, as FP8 checkpoints ship them: compressed-tensors and vLLM
# (`self_attn.k_scale`, `self_attn.attn.k_scale`), ModelOpt (`self_attn.k_proj.k_scale`), AutoFP8's older single
# scale for both (`self_attn.kv_scale`, or on k_proj / v_proj).
_KV_SCALE_NAME = re.compile(r"^(?P<block>.+?)(?:\.(?P<part>k_proj|v_proj|attn))?\.(?P<kind>k_scale|v_scale|kv_scale)$")
# FP8 attention's other scales (query, softmax probabilities): shardserve computes attention in float32 and reads
# none of them.
UNUSED_ATTENTION_SCALES = (".q_scale", ".prob_scale")


def cache_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype cache slots hold for a `--kv-cache-dtype` value ("auto": the model's compute dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return {"auto": compute_dtype, "bfloat16": torch.bfloat16}.get(kv_cache_dtype, FP8)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def describe(dtype: torch.dtype) -> str:
    return "fp8_e4m3" if is_fp8(dtype) else str(dtype).removeprefix("torch.")


def encode(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: divided by `scale`, saturated and rounded to e4m3 for an FP8 cache; else cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def decode(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What attention reads for stored cache values, in `dtype`: stored * scale (computed in float32) for FP8."""
    if not is_fp8(stored.dtype):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)


def round_like_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x (any float dtype) after a trip through a cache of `dtype`, in x's dtype: the reference's rounding."""
    return decode(encode(x, scale, dtype), scale, x.dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float, padded: bool = False) -> None:
    """cache[slots] = x, encoded (torch ops: the SDPA path, the latent cache). FP8 rows are copied as their bytes:
    CPUs have no float8 index_copy_. padded: rows of slot -1 (a CUDA graph's padding rows) store nothing, without
    reading the slots on the host (each such row writes slot 0's own contents back: block 0 is never a sequence's)."""
    values = encode(x, scale, cache.dtype)
    if is_fp8(cache.dtype):
        cache, values = cache.view(torch.uint8), values.view(torch.uint8)
    if padded:
        pad = (slots < 0).view(-1, *([1] * (values.dim() - 1)))
        slots = slots.clamp(min=0)
        values = torch.where(pad, cache[slots], values)
    cache.index_copy_(0, slots, values)


def scale_target(name: str) -> tuple[str, str] | None:
    """For a checkpoint tensor holding a KV scale: (the attention block's name, "k", "v" or "kv" for both);
    None for any other tensor."""
    match = _KV_SCALE_NAME.match(name)
    if match is None:
        return None
    kind = match["kind"][0] if match["kind"] != "kv_scale" else {"k_proj": "k", "v_proj": "v"}.get(match["part"], "kv")
    return match["block"], kind


def scale_value(name: str, tensor) -> float:
    """The one positive number a KV scale tensor holds; errors name the tensor."""
    values = (tensor if isinstance(tensor, torch.Tensor) else tensor[...]).float().reshape(-1)  # 0-dim slices too
    if values.numel() != 1 or not bool(torch.isfinite(values).all()) or float(values[0]) <= 0:
        raise ValueError(f"KV scale {name!r} must be one positive number (a scale per tensor), got "
                         f"{values.numel()} values {values[:4].tolist()}")
    return float(values[0])
