import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
