"""One decode step of the short causal depthwise convolution (kernels/causal_conv1d.py) for B sequences, each
sequence's state read from and written back to its slot of a pool: Gated DeltaNet's and Mamba-2's.

Program (row, block of channels) reads the row's convolution state [channels, K - 1] from its pool slot, writes
y = silu(conv(state, x) + bias) and shifts x into the state, in place. A row whose slot is negative (a CUDA
graph's padding row) reads and writes no state; its outputs are meaningless and never read. Invariant: the rows
of one call have distinct slots (one sequence a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONV_BLOCK = 256  # channels a program covers


@triton.jit
def _conv_step_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, slots_ptr, y_ptr, channels, stride_x, stride_slot,
                      KERNEL: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < channels
    slot = tl.load(slots_ptr + row)
    live = inside & (slot >= 0)
    taps = tl.arange(0, TAPS)  # tap KERNEL - 1 is this token; taps before it come from the state, oldest first
    state_at = state_ptr + slot.to(tl.int64) * stride_slot + c[:, None] * (KERNEL - 1) + taps[None, :]
    from_state = taps[None, :] < KERNEL - 1
    window = tl.load(state_at, mask=live[:, None] & from_state, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + c, mask=inside, other=0.0)
    window = tl.where(taps[None, :] == KERNEL - 1, x.to(tl.float32)[:, None], window)
    w = tl.load(weight_ptr + c[:, None] * KERNEL + taps[None, :], mask=inside[:, None] & (taps[None, :] < KERNEL),
                other=0.0).to(tl.float32)
    y = tl.sum(window * w, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=inside, other=0.0).to(tl.float32)
    # Summed in float32 (with the bias) and rounded to x's dtype once, then SiLU: as the torch form does.
    y = y.to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * channels + c, (y * tl.sigmoid(y)).to(x.dtype), mask=inside)
    # The state keeps the last KERNEL - 1 inputs: taps 1 .. KERNEL - 1 of the window move to 0 .. KERNEL - 2.
    shifted = state_at - 1
    tl.store(shifted, window.to(state_ptr.dtype.element_ty), mask=live[:, None] & (taps[None, :] >= 1)
             & (taps[None, :] < KERNEL))


def conv_step_in_pool(x: torch.Tensor, weight: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token of each of B sequences: x [B, channels] (rows may be strided), weight [channels, K], pool
    [slots, channels, K - 1] (written in place), slots int64 [B], bias [channels] or None. Returns y [B, channels]
    in x's dtype."""
    rows, channels = x.shape
    kernel = weight.shape[1]
    y = torch.empty(rows, channels, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    grid = (rows, triton.cdiv(channels, _CONV_BLOCK))
    _conv_step_kernel[grid](x, weight, weight if bias is None else bias, pool, slots, y, channels, x.stride(0),
                            pool.stride(0), KERNEL=kernel, TAPS=triton.next_power_of_2(kernel),
                            HAS_BIAS=bias is not None, BLOCK=_CONV_BLOCK, num_warps=4)
    return y
