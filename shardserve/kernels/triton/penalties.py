"""The repetition, frequency and presence penalties in one pass over the logits (CUDA).

The torch version (engine/sampler.py) gathers the penalized rows and their token counts, and runs a dozen
element-wise operations over [rows, vocab] float32 tensors; at 256 rows of a 128k vocabulary that is about a
millisecond of device time a step. Here each program reads a block of one row's logits, the same block of its
sequence's counts and prompt mask (through the sequence's slot, without gathering them), and writes the
penalized logits back in place: one read and one write of the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _penalties_kernel(logits_ptr, rows_ptr, slots_ptr, counts_ptr, in_prompt_ptr, factors_ptr, vocab,
                      stride_logits, stride_counts, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < vocab
    row = tl.load(rows_ptr + i).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    repetition = tl.load(factors_ptr + i * 3)
    frequency = tl.load(factors_ptr + i * 3 + 1)
    presence = tl.load(factors_ptr + i * 3 + 2)
    x = tl.load(logits_ptr + row * stride_logits + offsets, mask=inside, other=0.0)
    counts = tl.load(counts_ptr + slot * stride_counts + offsets, mask=inside, other=0.0)
    in_prompt = tl.load(in_prompt_ptr + slot * stride_counts + offsets, mask=inside, other=0) != 0
    seen = counts > 0
    repeated = tl.where(x > 0, x / repetition, x * repetition)
    x = tl.where(seen | in_prompt, repeated, x)
    x = x - (counts * frequency + seen.to(tl.float32) * presence)
    tl.store(logits_ptr + row * stride_logits + offsets, x, mask=inside)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    in_prompt: torch.Tensor, factors: torch.Tensor) -> None:
    """Penalize rows `rows` of float32 `logits` [n, vocab] in place: row rows[i] reads the token counts
    counts[slots[i]] (float32) and prompt mask in_prompt[slots[i]] (bool), with factors[i] = (repetition,
    frequency, presence) (float32 [r, 3])."""
    vocab = logits.shape[1]
    if rows.numel() == 0:
        return
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and counts.is_contiguous()
    assert in_prompt.dtype == torch.bool and in_prompt.is_contiguous() and factors.is_contiguous()
    grid = (rows.numel(), triton.cdiv(vocab, _BLOCK))
    _penalties_kernel[grid](logits, rows, slots, counts, in_prompt.view(torch.uint8), factors, vocab,
                            logits.stride(0), counts.stride(0), BLOCK=_BLOCK)
