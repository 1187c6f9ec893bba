"""A Mamba-2 layer's SSM decode step in one kernel that reads and writes each sequence's state in its pool slot.

Program (row, head, block of head_dim rows) reads the head's x rows and its group's B and C from the
convolution's output [x | B | C], computes dt = softplus(dt + dt_bias) clamped to time_step_limit and
dA = exp(dt * A) with A = -exp(A_log), steps the state rows it owns, S = S * dA + dt * x B^T, in float32 from the
pool's dtype (float32, bfloat16 or float16: stored rounded), and writes y = S C + D x (kernels/mamba2_ssd.ssd_step).

A row whose slot is negative (a CUDA graph's padding row) reads and writes no state; its outputs are
meaningless and never read. Invariant: the rows of one call have distinct slots (one sequence a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton.activations import softplus

ROW_BLOCK = 16  # head_dim rows of one head's state a program owns (16 x state_size values)


@triton.jit
def program_cells(state_ptr, slots_ptr, stride_slot, P: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr,
                  BP: tl.constexpr):
    """What program (row, head, block of BP head_dim rows) owns: (row, head, its head_dim rows p and state columns n
    with their masks p_in and n_in, the row's slot, the state cells' addresses [BP, N_POW2] and their mask, inside
    and of a live slot)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, N_POW2)
    p_in, n_in = p < P, n < N
    slot = tl.load(slots_ptr + row)
    cells = state_ptr + slot.to(tl.int64) * stride_slot + head * P * N + p[:, None] * N + n[None, :]
    return row, head, p, n, p_in, n_in, slot, cells, p_in[:, None] & n_in[None, :] & (slot >= 0)


@triton.jit
def step_rows(s, x, b, c, dt_row, a_log_ptr, d_ptr, dt_bias_ptr, head, dt_low, dt_high):
    """One token through a head's state rows s [rows, state_size] (float32): dt = softplus(dt + dt_bias) clamped to
    [dt_low, dt_high], S = S * exp(-exp(A_log) * dt) + dt * x B^T, y = S C + D x. Returns (S, y [rows])."""
    dt = softplus(tl.load(dt_row + head).to(tl.float32) + tl.load(dt_bias_ptr + head))
    dt = tl.minimum(tl.maximum(dt, dt_low), dt_high)
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head)) * dt)
    s = s * decay + (dt * x)[:, None] * b[None, :]
    return s, tl.sum(s * c[None, :], axis=1) + tl.load(d_ptr + head) * x


@triton.jit
def _ssm_step_kernel(mixed_ptr, dt_ptr, a_log_ptr, d_ptr, dt_bias_ptr, state_ptr, slots_ptr, y_ptr,
                     dt_low, dt_high, stride_mixed, stride_dt, stride_slot, heads, groups,
                     P: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, BP: tl.constexpr):
    row, head, p, n, p_in, n_in, slot, at, cell = program_cells(state_ptr, slots_ptr, stride_slot, P, N, N_POW2, BP)
    group = head // (heads // groups)
    base = mixed_ptr + row * stride_mixed
    x = tl.load(base + head * P + p, mask=p_in, other=0.0).to(tl.float32)
    b = tl.load(base + heads * P + group * N + n, mask=n_in, other=0.0).to(tl.float32)
    c = tl.load(base + heads * P + (groups + group) * N + n, mask=n_in, other=0.0).to(tl.float32)
    s = tl.load(at, mask=cell, other=0.0).to(tl.float32)
    s, y = step_rows(s, x, b, c, dt_ptr + row * stride_dt, a_log_ptr, d_ptr, dt_bias_ptr, head, dt_low, dt_high)
    tl.store(at, s.to(state_ptr.dtype.element_ty), mask=cell)
    tl.store(y_ptr + (row * heads + head) * P + p, y, mask=p_in)


def ssm_step_in_pool(mixed: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, d: torch.Tensor,
                     dt_bias: torch.Tensor, time_step_limit: tuple[float, float], groups: int, pool: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences through the SSM, from the convolution's output.

    mixed [B, heads * head_dim + 2 * groups * state_size]: [x | B | C] a row; dt [B, heads]: the input
    projection's step before softplus (rows may be strided); a_log, d, dt_bias float32 [heads]; pool [slots,
    heads, head_dim, state_size] in any float dtype (written in place); slots int64 [B]. Returns y float32
    [B, heads, head_dim].
    """
    rows = mixed.shape[0]
    heads, head_dim, state_size = pool.shape[1:]
    y = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=mixed.device)
    if rows == 0:
        return y
    if mixed.stride(1) != 1 or dt.stride(1) != 1 or not pool[0].is_contiguous():
        raise ValueError("ssm_step_in_pool needs unit-strided rows of mixed and dt and each slot's state contiguous")
    block = min(ROW_BLOCK, triton.next_power_of_2(head_dim))
    grid = (rows, heads, triton.cdiv(head_dim, block))
    low, high = time_step_limit
    _ssm_step_kernel[grid](mixed, dt, a_log, d, dt_bias, pool, slots, y, float(low), float(high), mixed.stride(0),
                           dt.stride(0), pool.stride(0), heads, groups, P=head_dim, N=state_size,
                           N_POW2=triton.next_power_of_2(state_size), BP=block, num_warps=4)
    return y
