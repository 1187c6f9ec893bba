"""GGUF-style block quantization recovered from dequantized weights, exactly or not at all.

A GGUF checkpoint stores most weights as blocks of 32 along the input dimension: Q4_1 as w = d * q + m (q in
0..15, d and m float16 per block), Q4_0 as the special case m = -8 d, Q8_0 as w = d * q (q in -127..127).
A symmetric 4-bit GPTQ checkpoint is Q4_0 in disguise: w = s * (q - 8) with one scale per group of 32, 64 or
128 input features (in order, without act order), so each block of 32 has the form with d = s.
The loader dequantizes them to float32 and shards them like any weight. From a rank's float32 slice this
module finds d, q (and m) again, and returns them only if d * q (+ m), computed in float32 exactly as the
dequantizer did, gives back every value bit for bit: the 4- or 8-bit form then holds exactly the weights the
model computes with, in a fifth or a quarter of the bytes. A slice whose blocks do not line up with the
file's (a shard boundary inside a block), or weights that never were quantized, simply do not recover.
"""

from __future__ import annotations

import torch

BLOCK = 32


def _blocks(w: torch.Tensor) -> torch.Tensor | None:
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % BLOCK or w.numel() == 0:
        return None
    return w.reshape(w.shape[0], w.shape[1] // BLOCK, BLOCK)


def recover_4bit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q packed two per byte [N, K / 2] uint8, d [N, K / 32], m [N, K / 32]) with w = d * q + m exactly, or None.
    Byte i of a block holds q[i] in its low and q[i + 16] in its high nibble."""
    blocks = _blocks(w)
    if blocks is None:
        return None
    # Q4_1: the block's smallest weight has q = 0 and its largest q = 15.
    m = blocks.amin(-1, keepdim=True)
    d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
    found = _levels(blocks, d, m)
    if found is None:
        if _q4_0(blocks[:1]) is None:  # weights of another form fail on the first row already
            return None
        q4_0 = _q4_0(blocks)
        if q4_0 is None:
            return None
        d, found = q4_0
        m = -8 * d
    q = found.to(torch.uint8)
    packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return packed.reshape(w.shape[0], -1).contiguous(), d.squeeze(-1).contiguous(), m.squeeze(-1).contiguous()


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_0's d per block and q in 0..15 (w = d * (q - 8) bit for bit), or None where a block has no such form.
    The weight of largest magnitude is d * l for a level l in -8..7: GGUF's Q4_0 puts it at -8 (d of either
    sign); a symmetric GPTQ group at -7 or 7, and a block inside a larger group lower. Levels are tried from the
    largest magnitude down, each block keeping the first that gives back all of its values."""
    extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    chosen_d, chosen_q = torch.zeros_like(extreme), torch.zeros_like(blocks)
    done = torch.zeros_like(extreme, dtype=torch.bool)
    for level in (-8, -7, 7, -6, 6, -5, 5, -4, 4, -3, 3, -2, 2, -1, 1):  # d may take either sign
        d = extreme / level
        q = torch.round(blocks / torch.where(d == 0, 1, d) + 8).clamp_(0, 15)
        exact = (d * q - 8 * d == blocks).all(-1, keepdim=True)
        take = exact & ~done
        chosen_d, chosen_q = torch.where(take, d, chosen_d), torch.where(take, q, chosen_q)
        done |= exact
        if bool(done.all()):
            return chosen_d, chosen_q
    return None


def _levels(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """q in 0..15 with d * q + m == blocks bit for bit, or None."""
    q = torch.round((blocks - m) / torch.where(d == 0, 1, d)).clamp_(0, 15)
    return q if torch.equal(d * q + m, blocks) else None


def recover_8bit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [N, K] int8, d [N, K / 32]) with w = d * q exactly, or None."""
    blocks = _blocks(w)
    if blocks is None:
        return None
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()  # the block's largest |q| is 127
    q = torch.round(blocks / torch.where(d == 0, 1, d)).clamp_(-127, 127)
    if not torch.equal(d * q, blocks):
        return None
    return q.to(torch.int8).reshape(w.shape).contiguous(), d.squeeze(-1).contiguous()
