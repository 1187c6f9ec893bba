"""How a linear layer's matmul runs on this hardware, chosen once at start-up.

- "torch": F.linear on the weight as loaded (GPUs, and CPUs where nothing better applies).
- "onednn-packed": on CPUs, the weight is re-laid out once into oneDNN's blocked format and
  multiplied with oneDNN's JIT kernels. On CPUs where MKL's sgemm takes a slow generic path (AVX2
  parts of other vendors), this is about 1.5x faster for decode-sized batches and up to 3x for the
  LM head; in bfloat16 (CPUs with fast bfloat16 matmuls) 1.5x to 1.8x. The packed copy replaces the
  loaded weight, so memory does not double.
- "bf16-decode": on CPUs without fast bfloat16 matmuls, a 16-bit checkpoint keeps a bfloat16 copy of
  each weight for single-token steps (half the bytes a batch-1 decode step reads; a small AVX2 kernel
  in shardserve/kernels widens it in registers, activations stay float32), and the oneDNN-packed
  float32 form for larger batches, where that kernel is slower. It holds 1.5x the float32 weight bytes.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Batch size oneDNN tunes the packed layout for; any batch size still works with it.
PACK_BATCH_HINT = 16


class LinearKernel:
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDNNPackedKernel(LinearKernel):
    name = "onednn-packed"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
        return out.reshape(*shape[:-1], out.shape[-1])


class BF16DecodeKernel(LinearKernel):
    name = "bf16-decode"

    def __init__(self, extension) -> None:
        self.extension = extension
        self.batched = OneDNNPackedKernel()

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return weight.to(torch.bfloat16).contiguous(), self.batched.prepare(weight)

    def __call__(self, x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor],
                 bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] != 1:
            return self.batched(x, weight[1], bias)
        out = self.extension.bf16_weight_linear(x, weight[0])
        return out if bias is None else out + bias


def choose_linear_kernel(device: torch.device, dtype: torch.dtype, keep_bf16_weights: bool = False) -> LinearKernel:
    """keep_bf16_weights: the checkpoint is in 16-bit floats, computed in float32 on a CPU."""
    if device.type != "cpu":
        return LinearKernel()
    if dtype == torch.bfloat16:
        # CPUs with fast bfloat16 matmuls: oneDNN's blocked layout beats F.linear's path on the weight as
        # loaded, 1.5x for single-token steps and 1.8x at 16 rows on an AVX-512 BF16 part (SmolLM2 shapes).
        return OneDNNPackedKernel() if _onednn_linear_works(torch.bfloat16) else LinearKernel()
    if dtype != torch.float32:
        return LinearKernel()
    if keep_bf16_weights:
        from shardserve.kernels import bf16_gemv

        extension = bf16_gemv.load()
        if extension is not None and _onednn_linear_works():
            return BF16DecodeKernel(extension)
    if _onednn_linear_works():
        return OneDNNPackedKernel()
    return LinearKernel()


@functools.cache
def _onednn_linear_works(dtype: torch.dtype = torch.float32) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 64).to(dtype), torch.randn(2, 64).to(dtype)
        out = OneDNNPackedKernel()(x, OneDNNPackedKernel().prepare(w), None)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        expected = F.linear(x, w).float()
        return out.dtype == dtype and torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance)
    except (RuntimeError, AttributeError):
        return False


def pack_linear_weights(model: nn.Module, kernel: LinearKernel) -> int:
    """Give every layer with a `use_kernel` hook the kernel; returns how many layers were packed."""
    count = 0
    for module in model.modules():
        hook = getattr(module, "use_kernel", None)
        if hook is not None:
            hook(kernel)
            count += 1
    return count
