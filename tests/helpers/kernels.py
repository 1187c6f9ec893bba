"""Random quantized weights with their float64 formulas, random router choices, packed layers and the relative
error: what several kernel tests build their cases from. On CUDA the tensors are made on the GPU."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.kernels.quant_pack import pack_scale_zero
from shardserve.layers.linear import ColumnParallelLinear
from shardserve.layers.quantization.packed import PackedLayout, PackedWeights

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# (N, K) of Llama-3-8B's qkv, o, gate_up and down projections at TP 1, and of the same at TP 2.
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
             (3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]


def random_int4(n: int, k: int, group: int, device=DEVICE, seed: int = 0):
    """(q [N, K] int64 in 0..15, scale_zero [N, K // group] int32): random scales, zero points 0..16."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, device=device)
    scale = torch.rand(n, k // group, generator=g, device=device) * 0.02 + 0.002
    zero = torch.randint(0, 17, (n, k // group), generator=g, device=device)
    return q, pack_scale_zero(scale, zero)


def random_fp8(n: int, k: int, group_k: int, device=DEVICE, seed: int = 0):
    """(weight float8_e4m3fn [N, K], scale float32 [N, ceil(K / group_k)])."""
    g = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(n, k, generator=g, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // group_k), generator=g, device=device) * 1e-3 + 1e-4
    return weight, scale


def scale_and_zero(scale_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (scale, zero) of scale-and-zero words: the float32 scale with its low 5 bits holding the zero."""
    return (scale_zero & -32).view(torch.float32).double(), (scale_zero & 31).double()


def int4_reference(q, scale_zero, group) -> torch.Tensor:
    column_group = torch.arange(q.shape[1], device=q.device) // group
    scale, zero = scale_and_zero(scale_zero)
    return (q.double() - zero[:, column_group]) * scale[:, column_group]


def fp8_reference(weight, scale, group_k) -> torch.Tensor:
    column_group = torch.arange(weight.shape[1], device=weight.device) // group_k
    return weight.double() * scale.double()[:, column_group]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def make_routes(tokens, num_experts, top_k, dtype, hidden, seed=1, ids_dtype=torch.int64):
    """x and the router's choices: the top k of random logits, weights renormalised to sum to 1."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g, device=DEVICE)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return x, weights / weights.sum(dim=-1, keepdim=True), ids.to(ids_dtype)


def packed_layer(n: int, k: int, layout: PackedLayout, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A column-parallel layer of [n, k], packed, loaded from random float weights (quantized at load)."""
    layer = ColumnParallelLinear(k, {None: (0, n)}, False, dtype).to(DEVICE)
    layer.packed = PackedWeights(layer, layout, DEVICE)
    weights = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * k ** -0.5
    layer.weight.weight_loader(layer.weight, weights, None)
    return layer
