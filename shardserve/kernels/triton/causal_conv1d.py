"""One decode step of the short causal depthwise convolution (kernels/causal_conv1d.py) for B sequences, each
sequence's state read from and written back to its slot of a pool: Gated DeltaNet's and Mamba-2's.

Program (row, block of channels) reads the row's convolution state [channels, K - 1] from its pool slot, writes
y = silu(conv(state, x) + bias) and shifts x into the state, in place. A row whose slot is negative (a CUDA
graph's padding row) reads and writes no state; its outputs are meaningless and never read. Invariant: the rows
of one call have distinct slots (one sequence a row). Its pieces (loaded_channels, channels_step, shift_in) are
the one-kernel decode steps' of Gated DeltaNet and Mamba-2 too (kernels/triton/deltanet_decode.py,
mamba2_decode.py), which load what loaded_channels loads before their dependent-launch wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONV_BLOCK = 256  # channels a program covers


@triton.jit
def state_window(state_row, c, inside, live, KERNEL: tl.constexpr, TAPS: tl.constexpr):
    """The part of channels c's convolution window the state holds, float32 [len(c), TAPS]: taps oldest first,
    0 .. KERNEL - 2 from the state at state_row ([channels, KERNEL - 1]; zeros where not `live` or not `inside`),
    zeros from tap KERNEL - 1 on (with_input puts the token's input there)."""
    taps = tl.arange(0, TAPS)
    from_state = (inside & live)[:, None] & (taps[None, :] < KERNEL - 1)
    return tl.load(state_row + c[:, None] * (KERNEL - 1) + taps[None, :], mask=from_state, other=0.0).to(tl.float32)


@triton.jit
def with_input(window, x_row, c, inside, KERNEL: tl.constexpr, TAPS: tl.constexpr):
    """state_window's window with this token's input of channels c, from x_row, as tap KERNEL - 1."""
    taps = tl.arange(0, TAPS)
    x = tl.load(x_row + c, mask=inside, other=0.0)
    return tl.where(taps[None, :] == KERNEL - 1, x.to(tl.float32)[:, None], window)


@triton.jit
def tap_weights(weight_ptr, c, inside, KERNEL: tl.constexpr, TAPS: tl.constexpr):
    """Channels c's convolution weights as loaded, [len(c), TAPS] (zeros past KERNEL taps); weight [channels,
    KERNEL] contiguous."""
    taps = tl.arange(0, TAPS)
    return tl.load(weight_ptr + c[:, None] * KERNEL + taps[None, :], mask=inside[:, None] & (taps[None, :] < KERNEL),
                   other=0.0)


@triton.jit
def convolve(window, weights):
    """The convolution of channels over their window (with_input's) and tap weights (tap_weights), summed in
    float32."""
    return tl.sum(window * weights.to(tl.float32), axis=1)


@triton.jit
def rounded_silu(y, dtype: tl.constexpr):
    """silu of the convolution's float32 sum rounded to `dtype` once, rounded to `dtype`: as the torch form does."""
    y = y.to(dtype).to(tl.float32)
    return (y * tl.sigmoid(y)).to(dtype)


@triton.jit
def shift_in(state_row, c, window, ok, KERNEL: tl.constexpr, TAPS: tl.constexpr):
    """The state keeps the last KERNEL - 1 inputs: taps 1 .. KERNEL - 1 of the window move to 0 .. KERNEL - 2 of
    channels c where ok."""
    taps = tl.arange(0, TAPS)
    tl.store(state_row + c[:, None] * (KERNEL - 1) + taps[None, :] - 1, window.to(state_row.dtype.element_ty),
             mask=ok[:, None] & (taps[None, :] >= 1) & (taps[None, :] < KERNEL))


@triton.jit
def window_and_output(x_row, weight_ptr, bias_ptr, state_row, c, inside, live, KERNEL: tl.constexpr,
                      TAPS: tl.constexpr, HAS_BIAS: tl.constexpr = False):
    """Channels c's window for this token (taps oldest first: the state's, then x_row's input) and their output as
    the convolution step stores it: silu(conv + bias), rounded to x's dtype (rounded_silu), held in float32."""
    loaded = loaded_channels(state_row, weight_ptr, bias_ptr, c, inside, live, KERNEL, TAPS, HAS_BIAS)
    return channels_step(x_row, loaded, c, inside, KERNEL, TAPS)


@triton.jit
def loaded_channels(state_row, weight_ptr, bias_ptr, c, inside, live, KERNEL: tl.constexpr, TAPS: tl.constexpr,
                    HAS_BIAS: tl.constexpr = False):
    """What channels c's step needs besides this token's input: their window from the state (state_window), their
    tap weights and their bias (float32 zeros without one). The one-kernel decode steps load them before their
    dependent-launch wait."""
    bias = tl.zeros(c.shape, dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=inside, other=0.0).to(tl.float32)
    return (state_window(state_row, c, inside, live, KERNEL, TAPS), tap_weights(weight_ptr, c, inside, KERNEL, TAPS),
            bias)


@triton.jit
def channels_step(x_row, loaded, c, inside, KERNEL: tl.constexpr, TAPS: tl.constexpr):
    """Channels c's window with this token's input (from x_row) and their output silu(conv + bias) rounded to x's
    dtype (rounded_silu), held in float32, from loaded_channels' loads."""
    window, weights, bias = loaded
    window = with_input(window, x_row, c, inside, KERNEL, TAPS)
    return window, rounded_silu(convolve(window, weights) + bias, x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _conv_step_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, slots_ptr, y_ptr, channels, stride_x, stride_slot,
                      KERNEL: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < channels
    slot = tl.load(slots_ptr + row)
    state_row = state_ptr + slot.to(tl.int64) * stride_slot
    window, y = window_and_output(x_ptr + row * stride_x, weight_ptr, bias_ptr, state_row, c, inside, slot >= 0,
                                  KERNEL, TAPS, HAS_BIAS)
    tl.store(y_ptr + row * channels + c, y, mask=inside)
    shift_in(state_row, c, window, inside & (slot >= 0), KERNEL, TAPS)


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
