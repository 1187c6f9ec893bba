"""A Gated DeltaNet layer's decode step in two kernels that read and write the sequences' states in their pools.

The torch form of a decode step (layers/deltanet_kernels.TorchDeltaNetKernels) gathers each sequence's states
out of the pools, steps them and scatters them back, and computes the gates, the l2 norms and the convolution in
a dozen small kernels. Here:

- the convolution: kernels/triton/causal_conv1d.conv_step_in_pool (shared with Mamba-2), stepping each row's
  convolution state in its pool slot.
- `rule_step_in_pool`: program (row, value head, block of value columns) reads q and k of its key head and v of
  its columns from the convolution's output, l2-normalises q and k, computes beta = sigmoid(b) and the log decay
  g = -exp(A_log) * softplus(a + dt_bias), and steps the float32 state columns it owns in place (the delta rule
  of kernels/gated_delta_rule.py) while writing o (`step_columns`, which kernels/triton/deltanet_decode.py's one
  kernel for the whole step runs too).

A row whose slot is negative (a CUDA graph's padding row) reads and writes no state; its outputs are
meaningless and never read. Invariant: the rows of one call have distinct slots (one sequence a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton.activations import softplus

VALUE_BLOCK = 32  # value columns of one head a program of the delta rule owns (its state: key_dim x 32 float32)


@triton.jit
def step_columns(q, k, v, b, a, a_log, dt_bias, s, scale):
    """The delta rule of one value head on the state columns one program owns: q, k float32 [DK_POW2] of its key
    head (zeros past key_dim), not yet normalised; v float32 [BV] of its columns; b, a the row's gate inputs of
    this head and a_log, dt_bias its parameters, float32; s [DK_POW2, BV] the float32 state cells as loaded (zeros
    outside the state). Returns the stepped cells and o float32 [BV]; the caller stores the cells."""
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    decay = tl.exp(-tl.exp(a_log) * softplus(a + dt_bias))
    beta = tl.sigmoid(b)
    s = s * decay
    write = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * write[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


@triton.jit
def gate_inputs(ba_row, head, value_heads):
    """step_columns' b and a of value head `head`, float32, from the row's [b | a]."""
    return tl.load(ba_row + head).to(tl.float32), tl.load(ba_row + value_heads + head).to(tl.float32)


@triton.jit
def _rule_step_kernel(mixed_ptr, ba_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, o_ptr, scale,
                      stride_mixed, stride_ba, stride_slot, key_heads, value_heads,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_POW2: tl.constexpr,
                      BV: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    slot = tl.load(slots_ptr + row)
    keys = tl.arange(0, DK_POW2)
    key_in, col_in = keys < DK, cols < DV
    base = mixed_ptr + row * stride_mixed
    key_head = head // GROUP
    q = tl.load(base + key_head * DK + keys, mask=key_in, other=0.0).to(tl.float32)
    k = tl.load(base + key_heads * DK + key_head * DK + keys, mask=key_in, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * key_heads * DK + head * DV + cols, mask=col_in, other=0.0).to(tl.float32)
    at = state_ptr + slot.to(tl.int64) * stride_slot + head * DK * DV + keys[:, None] * DV + cols[None, :]
    cell = key_in[:, None] & col_in[None, :] & (slot >= 0)
    b, a = gate_inputs(ba_ptr + row * stride_ba, head, value_heads)
    s, o = step_columns(q, k, v, b, a, tl.load(a_log_ptr + head), tl.load(dt_bias_ptr + head),
                        tl.load(at, mask=cell, other=0.0), scale)
    tl.store(at, s, mask=cell)
    tl.store(o_ptr + (row * value_heads + head) * DV + cols, o, mask=col_in)


def rule_step_in_pool(mixed: torch.Tensor, ba: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                      scale: float, pool: torch.Tensor, slots: torch.Tensor, key_heads: int) -> torch.Tensor:
    """One token of each of B sequences through the gated delta rule, from the convolution's output.

    mixed [B, 2 * key_heads * dk + value_heads * dv]: [q | k | v] a row (not yet normalised); ba [B, 2 *
    value_heads]: [b | a] a row; a_log, dt_bias float32 [value_heads]; pool float32 [slots, value_heads, dk, dv]
    (written in place); slots int64 [B]. Returns o float32 [B, value_heads, dv].
    """
    rows = mixed.shape[0]
    value_heads, dk, dv = pool.shape[1:]
    o = torch.empty(rows, value_heads, dv, dtype=torch.float32, device=mixed.device)
    if rows == 0:
        return o
    block = min(VALUE_BLOCK, triton.next_power_of_2(dv))
    grid = (rows, value_heads, triton.cdiv(dv, block))
    _rule_step_kernel[grid](mixed, ba, a_log, dt_bias, pool, slots, o, scale, mixed.stride(0), ba.stride(0),
                            pool.stride(0), key_heads, value_heads, GROUP=value_heads // key_heads, DK=dk, DV=dv,
                            DK_POW2=triton.next_power_of_2(dk), BV=block, num_warps=4)
    return o
