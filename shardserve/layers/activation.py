import torch
import torch.nn.functional as F

from shardserve.kernels.availability import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection (one Triton kernel on CUDA)."""
    if use_triton(x) and x.is_contiguous():
        from shardserve.kernels.triton.fused_ops import silu_and_mul as fused

        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
