"""Activations shared by Triton kernels, computed as torch computes them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(x):
    """log(1 + exp(x)) in float32, x itself above 20: torch's F.softplus threshold."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
