"""How a linear layer's matmul runs on this hardware, chosen once at start-up.

- "torch": F.linear on the weight as loaded (GPUs, and CPUs where nothing better applies).
- "onednn-packed": on CPUs, the weight is re-laid out once into oneDNN's blocked format and
  multiplied with oneDNN's JIT kernels. On CPUs where MKL's sgemm takes a slow generic path (AVX2
  parts of other vendors), this is about 1.5x faster for decode-sized batches and up to 3x for the
  LM head; in bfloat16 (CPUs with fast bfloat16 matmuls) 1.5x to 1.8x. The packed copy replaces the
  loaded weight, so memory does not double.
- "bf16-decode": on CPUs computing in float32, a bfloat16 checkpoint keeps a bfloat16 copy of each weight
  for single-token steps (half the bytes a batch-1 decode step reads; a small AVX2 kernel in
  shardserve/kernels widens it in registers, activations stay float32), and the oneDNN-packed float32 form
  for larger batches, where that kernel is slower. Both hold exactly the checkpoint's values (widening
  bfloat16 to float32 is exact), so a request meets the same weights alone or in a batch; the plan offers
  it only for bfloat16 checkpoints, and the start-up check would catch weights that bfloat16 cannot hold.
  It holds 1.5x the float32 weight bytes.
- "blockq-decode": the same idea for GGUF-quantized checkpoints: weights that are exactly 4-bit (Q4_0/Q4_1)
  or 8-bit (Q8_0) blocks of 32 keep that form for decode-sized steps (0.75 or 1.13 bytes a weight instead of
  4), the packed float32 form for prompts.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

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


class CompactDecodeKernel(LinearKernel):
    """A compact copy of each weight for steps of up to MAX_ROWS rows, read by an AVX2 extension, beside the
    oneDNN-packed float32 form for longer steps. Both hold the same values, so a request meets the same weights
    alone or in a batch. Prepared weights are flat tuples (packed float32, *compact), so sleep and wake move
    every tensor (weights/offload.py); a weight with no compact form is (packed float32,)."""

    MAX_ROWS = 1

    def __init__(self, extension) -> None:
        self.extension = extension
        self.batched = OneDNNPackedKernel()

    def compact(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def compact_linear(self, x: torch.Tensor, compact: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.batched.prepare(weight), *self.compact(weight))

    def __call__(self, x: torch.Tensor, weight: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> torch.Tensor:
        if len(weight) == 1 or x.dim() != 2 or x.shape[0] > self.MAX_ROWS:
            return self.batched(x, weight[0], bias)
        out = self.compact_linear(x, weight[1:])
        return out if bias is None else out + bias


class BF16DecodeKernel(CompactDecodeKernel):
    name = "bf16-decode"

    def compact(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (weight.to(torch.bfloat16).contiguous(),)

    def compact_linear(self, x: torch.Tensor, compact: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.extension.bf16_weight_linear(x, compact[0])


class BlockQuantDecodeKernel(CompactDecodeKernel):
    """Weights that recover exactly into GGUF-style 4- or 8-bit blocks (kernels/block_quant.py) keep that form;
    a layer whose weights do not recover runs on the packed form alone."""

    name = "blockq-decode"
    MAX_ROWS = 2  # on a 2-core AVX-512 part: 1.5x oneDNN float32 at one row, 1.35x at two, slower from four

    def compact(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from shardserve.kernels.block_quant import recover_4bit, recover_8bit

        return recover_4bit(weight) or recover_8bit(weight) or ()

    def compact_linear(self, x: torch.Tensor, compact: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(compact) == 3:  # q, d, m
            return self.extension.q4_linear(x, *compact)
        return self.extension.q8_linear(x, *compact)


def build_linear_kernel(name: str) -> tuple[LinearKernel | None, str]:
    """The kernel of that name (kernels/plan.py LINEAR_KERNELS), or None and why it cannot run here. Whether it
    computes the right numbers is checked on the model's own shapes at start-up (engine/kernel_setup.py)."""
    if name == "torch":
        return LinearKernel(), ""
    if not torch.backends.mkldnn.is_available():
        return None, "this torch build has no oneDNN"
    if name == "onednn-packed":
        return OneDNNPackedKernel(), ""
    if name in ("bf16-decode", "blockq-decode"):
        from shardserve.kernels import cpu_extensions

        bf16 = name == "bf16-decode"
        extension = cpu_extensions.bf16_gemv() if bf16 else cpu_extensions.blockq_gemv()
        if extension is None:
            return None, f"the CPU extension of {name} could not be built (it needs AVX2/FMA and a C++ compiler)"
        return (BF16DecodeKernel if bf16 else BlockQuantDecodeKernel)(extension), ""
    raise ValueError(f"unknown linear kernel {name!r}")
