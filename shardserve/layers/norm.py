"""RMSNorm, computed in float32 like the reference implementations, with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import NORMED, reduced_first
from shardserve.kernels.availability import use_triton


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, offset: bool = False) -> None:
        """offset: the checkpoint stores w where the norm scales by 1 + w (Qwen3-Next); the weight loaded here is
        then 1 + w, so every kernel that reads `weight` computes the same norm."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        if offset:
            self.weight.weight_loader = _load_plus_one

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce=None, next_early: bool = False):
        """Returns norm(x) or, with a residual, (norm(x + residual), x + residual).

        On CUDA one Triton kernel does the add and the norm (x and residual are then updated in place);
        `next_early`: a linear layer's product comes next, so its launch may be placed at the norm's start
        (kernels/triton/pdl.py's early launches).
        With `reduce` (a Communicator), x is a partial sum still to be all-reduced over the ranks first; where
        the communicator can, the all-reduce, the add and the norm are one kernel. With `reduce` NORMED, x is
        already the norm's output and residual the sum (RowParallelLinear.forward_add): returned as they are.
        """
        x, residual, reduce = reduced_first(x, residual, self, reduce)
        if reduce is NORMED:
            return x, residual
        if use_triton(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            from shardserve.kernels.triton.fused_ops import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps, next_early)
            return fused_add_rms_norm(x, residual, self.weight, self.eps, next_early)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, same numbers
        else:
            # Normalise in float32, round to the model's dtype, then scale, as the reference does.
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def with_sum(self, x: torch.Tensor, residual: torch.Tensor | None, next_early: bool = False):
        """(norm(x + residual), x + residual) as forward's; without a residual (a first layer), (norm(x), x)."""
        if residual is None:
            return self(x, next_early=next_early), x
        return self(x, residual, next_early=next_early)


def _load_plus_one(param: nn.Parameter, loaded, shard_id=None) -> None:
    """1 + w, added in float32 as the reference does (it scales by 1.0 + w.float())."""
    w = torch.as_tensor(loaded[:]) if not isinstance(loaded, torch.Tensor) else loaded
    if tuple(w.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(1.0 + w.float())


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension (one head), then times silu(gate): Gated DeltaNet's output norm.

    Normalised in float32 and scaled by the weight in x's dtype, then gated in float32, as the reference
    (Qwen3-Next's RMSNormGated) does. The weight is the head's width, the same for every head and every rank.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward_rows(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """gated_rms_norm_rows with this norm's weight and eps."""
        return gated_rms_norm_rows(o, z, self.weight, self.eps)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _gated_rms_norm(x, gate, self.weight, self.eps)


def gated_rms_norm_rows(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm of each head of the delta rule's float32 output o [rows, heads, D] gated by z [rows, heads * D]
    (a view of the input projection's output), as GatedRMSNorm(o.to(weight.dtype), z) flattened to [rows, heads *
    D]: one Triton kernel on CUDA."""
    if use_triton(o):
        from shardserve.kernels.triton.gated_rms_norm import gated_rms_norm

        return gated_rms_norm(o, z, weight, eps)
    return _gated_rms_norm(o.to(weight.dtype), z.reshape(o.shape), weight, eps).reshape(z.shape)


def _gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(gate.float())).to(x.dtype)
