"""A Mamba-2 layer's decode step in one kernel: from the input projection's outputs to the rows out_proj reads.

The same work as three launches (conv_step_in_pool, ssm_step_in_pool and grouped_gated_rms_norm, in
kernels/triton/causal_conv1d.py, mamba2_step.py and gated_rms_norm.py), through the same jit helpers, so with the
same roundings: the convolution's output rounded to the model's dtype, SiLU, rounded again; the state stepped in
float32 and stored in the pool's dtype; y kept in float32 into the norm, weight * norm(y * silu(z)) over each group
of heads, the normalised values rounded before the weight.

Programs: (row, head, block of BP head_dim rows), as the SSM step's kernel: at batch 1 of Nemotron-3-Nano (64 heads
of 64 x 128 float32 state cells, BP 16) 256 programs, each streaming its 8 KB of state. Each program convolves what
it reads itself: its own x channels (BP of them) and its B/C group's 2 x state_size channels (the same in every
program of the group: about 3 KB more a program, from L2 after the first).

Who writes what (the invariant that keeps the convolution state free of races): x channels are read and written by
one program, its own, which shifts them in after its read. A group's B and C channels are read by every program of
that (row, group), in any order on a GPU, so none of them may shift them in while another may still read the old
window: each program counts itself in arrivals[row * groups + group] after its reads and stores
(kernels/triton/arrivals.py), and only the last to arrive, which every other has passed, writes the shifted B and C
window, from the window it read itself before any write. Rows hold distinct slots, so no two rows share a state.

The norm's group is the B/C group (heads // groups heads: NemotronH's group_size = inner // n_groups): each program
gates its own float32 y rows (y * silu(z), z read with its xbc channels) into a scratch row, and the same last program
reads the group's back (past its L1: other programs' stores) and writes weight * norm of them: one program forms each
sum, so the result does not depend on the order the programs finish. That tail (heads // groups x head_dim outputs,
512 in Nemotron-3-Nano: one load of the scratch, held, one store) is the only work done after the slowest program of
a group.

A row whose slot is negative (a CUDA graph's padding row) reads and writes no state; it counts and leaves its counts
at 0 like any row; its outputs are meaningless and never read. Launched with dependent launch (kernels/triton/
pdl.py): a program loads its slot, its state cells, its convolution windows and their weights before the wait,
which pdl.py's rule allows (only this layer's step writes its pools, in an earlier step; the step's slots are copied
in before its first kernel), and everything else after it. out_proj comes next: it is placed at this launch's start
(pdl.py's early launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.causal_conv1d import channels_step, loaded_channels, shift_in
from shardserve.kernels.triton.gated_rms_norm import weight_normed
from shardserve.kernels.triton.mamba2_step import ROW_BLOCK, program_cells, step_rows
from shardserve.kernels.triton.pdl import enter, launch_next

_NORM_BLOCK = 1024  # features of a group the norm's tail holds at once


@triton.jit
def _norm_group(h_at, weight_at, out_at, eps, FEATURES: tl.constexpr, BLOCK: tl.constexpr):
    """weight * norm(h) over one group's FEATURES gated features h = y * silu(z), float32 stored by other programs.
    A group within one block is loaded once and held (one round trip after the arrival); a wider one streams twice."""
    out_dtype = out_at.dtype.element_ty
    if FEATURES <= BLOCK:
        f = tl.arange(0, BLOCK)
        inside = f < FEATURES
        h = tl.load(h_at + f, mask=inside, other=0.0, cache_modifier=".cg")
        w = tl.load(weight_at + f, mask=inside, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / FEATURES + eps)
        tl.store(out_at + f, weight_normed(h * rstd, w, out_dtype), mask=inside)
    else:
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for f0 in tl.static_range(0, FEATURES, BLOCK):
            f = f0 + tl.arange(0, BLOCK)
            h = tl.load(h_at + f, mask=f < FEATURES, other=0.0, cache_modifier=".cg")
            total += h * h
        rstd = tl.rsqrt(tl.sum(total, axis=0) / FEATURES + eps)
        for f0 in tl.static_range(0, FEATURES, BLOCK):
            f = f0 + tl.arange(0, BLOCK)
            inside = f < FEATURES
            h = tl.load(h_at + f, mask=inside, other=0.0, cache_modifier=".cg")
            w = tl.load(weight_at + f, mask=inside, other=0.0).to(tl.float32)
            tl.store(out_at + f, weight_normed(h * rstd, w, out_dtype), mask=inside)


@triton.jit
def _step_norm_kernel(xbc_ptr, dt_ptr, z_ptr, conv_weight_ptr, conv_bias_ptr, a_log_ptr, d_ptr, dt_bias_ptr,
                      norm_weight_ptr, conv_pool_ptr, ssm_pool_ptr, slots_ptr, counts_ptr, y_ptr, out_ptr, dt_low,
                      dt_high, eps, stride_xbc, stride_dt, stride_z, stride_conv_slot, stride_ssm_slot, heads, groups,
                      P: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr, BP: tl.constexpr,
                      KERNEL: tl.constexpr, TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, FEATURES: tl.constexpr,
                      NORM_BLOCK: tl.constexpr, PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    if NEXT_EARLY:
        launch_next(PDL)
    row, head, p, n, p_in, n_in, slot, cells, cell = program_cells(ssm_pool_ptr, slots_ptr, stride_ssm_slot, P, N,
                                                                   N_POW2, BP)
    live = slot >= 0
    group_heads = heads // groups
    group = head // group_heads
    conv_row = conv_pool_ptr + slot.to(tl.int64) * stride_conv_slot
    x_channels = head * P + p
    b_channels = heads * P + group * N + n
    c_channels = b_channels + groups * N
    # Before the wait (pdl.py's rule): the state cells and the convolution's windows (only this layer's steps write
    # them, in an earlier step) and the weights.
    s = tl.load(cells, mask=cell, other=0.0).to(tl.float32)
    x_loaded = loaded_channels(conv_row, conv_weight_ptr, conv_bias_ptr, x_channels, p_in, live, KERNEL, TAPS,
                               HAS_BIAS)
    b_loaded = loaded_channels(conv_row, conv_weight_ptr, conv_bias_ptr, b_channels, n_in, live, KERNEL, TAPS,
                               HAS_BIAS)
    c_loaded = loaded_channels(conv_row, conv_weight_ptr, conv_bias_ptr, c_channels, n_in, live, KERNEL, TAPS,
                               HAS_BIAS)
    enter(PDL, NEXT_EARLY)
    x_row = xbc_ptr + row * stride_xbc
    z = tl.load(z_ptr + row * stride_z + head * P + p, mask=p_in, other=0.0).to(tl.float32)  # with xbc's loads
    x_window, x = channels_step(x_row, x_loaded, x_channels, p_in, KERNEL, TAPS)
    b_window, b = channels_step(x_row, b_loaded, b_channels, n_in, KERNEL, TAPS)
    c_window, c = channels_step(x_row, c_loaded, c_channels, n_in, KERNEL, TAPS)
    shift_in(conv_row, x_channels, x_window, p_in & live, KERNEL, TAPS)  # no other program reads these
    s, y = step_rows(s, x, b, c, dt_ptr + row * stride_dt, a_log_ptr, d_ptr, dt_bias_ptr, head, dt_low, dt_high)
    tl.store(cells, s.to(ssm_pool_ptr.dtype.element_ty), mask=cell)
    tl.store(y_ptr + (row * heads + head) * P + p, y * z * tl.sigmoid(z), mask=p_in)  # gated here, normed below
    count = row * groups + group
    if last_to_arrive(counts_ptr, count, group_heads * tl.num_programs(2)):
        # Every program of this group has read the B and C window: it may move now.
        shift_in(conv_row, b_channels, b_window, n_in & live, KERNEL, TAPS)
        shift_in(conv_row, c_channels, c_window, n_in & live, KERNEL, TAPS)
        first = row * heads * P + group * FEATURES
        _norm_group(y_ptr + first, norm_weight_ptr + group * FEATURES, out_ptr + first, eps, FEATURES, NORM_BLOCK)
        leave(counts_ptr, count)


def step_and_norm_in_pool(xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_weight: torch.Tensor,
                          conv_bias: torch.Tensor | None, a_log: torch.Tensor, d: torch.Tensor, dt_bias: torch.Tensor,
                          time_step_limit: tuple[float, float], groups: int, norm_weight: torch.Tensor,
                          group_size: int, eps: float, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                          slots: torch.Tensor) -> torch.Tensor | None:
    """One token of each of B sequences from the input projection's outputs to the gated norm's: xbc [B, channels]
    ([x | B | C] before the convolution), dt [B, heads] (before softplus), z [B, heads * head_dim] (rows may be
    strided, features unit-strided); conv_weight [channels, K] contiguous, conv_bias [channels] or None; a_log, d,
    dt_bias float32 [heads]; norm_weight [heads * head_dim] in the model's dtype, normed over groups of group_size
    features; conv_pool [slots, channels, K - 1] and ssm_pool [slots, heads, head_dim, state_size] (any float dtype),
    each slot contiguous (written in place); slots int64 [B], distinct. Returns [B, heads * head_dim] in
    norm_weight's dtype, or None where the norm's groups are not the B/C groups, or the device's arrival counts are
    too few for B x groups or not made yet inside a CUDA graph capture (the caller then takes the three kernels)."""
    rows = xbc.shape[0]
    heads, head_dim, state_size = ssm_pool.shape[1:]
    if heads % groups or group_size != heads // groups * head_dim:
        return None
    out = torch.empty(rows, heads * head_dim, dtype=norm_weight.dtype, device=xbc.device)
    if rows == 0:
        return out
    counts = arrival_counts(xbc.device, rows * groups)
    if counts is None:
        return None
    if xbc.stride(1) != 1 or dt.stride(1) != 1 or z.stride(1) != 1 or not ssm_pool[0].is_contiguous():
        raise ValueError("step_and_norm_in_pool needs xbc's, dt's and z's features unit-strided and each slot's "
                         "state contiguous")
    y = torch.empty(rows, heads * head_dim, dtype=torch.float32, device=xbc.device)
    kernel = conv_weight.shape[1]
    block = min(ROW_BLOCK, triton.next_power_of_2(head_dim))
    low, high = time_step_limit
    grid = (rows, heads, triton.cdiv(head_dim, block))
    _step_norm_kernel[grid](xbc, dt, z, conv_weight, conv_weight if conv_bias is None else conv_bias, a_log, d, dt_bias,
                            norm_weight, conv_pool, ssm_pool, slots, counts, y, out, float(low), float(high), eps,
                            xbc.stride(0), dt.stride(0), z.stride(0), conv_pool.stride(0), ssm_pool.stride(0), heads,
                            groups, P=head_dim, N=state_size, N_POW2=triton.next_power_of_2(state_size), BP=block,
                            KERNEL=kernel, TAPS=triton.next_power_of_2(kernel), HAS_BIAS=conv_bias is not None,
                            FEATURES=group_size, NORM_BLOCK=min(_NORM_BLOCK, triton.next_power_of_2(group_size)),
                            num_warps=4, **pdl.launch(xbc.device, next_early=True))
    return out
