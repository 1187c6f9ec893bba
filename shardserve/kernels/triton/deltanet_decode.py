"""A Gated DeltaNet layer's decode step in one kernel: from the input projections' outputs to the row out_proj reads.

The same work as three launches (conv_step_in_pool, rule_step_in_pool and gated_rms_norm, in kernels/triton/
causal_conv1d.py, gated_delta_rule.py and gated_rms_norm.py), through the same jit helpers, so with the same
roundings: the convolution's output rounded to the model's dtype, SiLU, rounded again; q and k l2-normalised; the
float32 state stepped in place; o rounded to the model's dtype before the norm, as the three kernels round.

Programs: (row, value head, block of BV value columns), as the delta rule's kernel: at batch 1 of Qwen3-Next (32
value heads of 128 columns, BV 32) 128 programs, each streaming its [key_dim, BV] float32 state cells (16 KB read
and written). A layer's states are 2 MB a sequence, and a decode step is bound by moving them: a program per
whole head would leave three quarters of an H200's 132 SMs idle, each of the others with a 64 KB tile. Each
program convolves what it reads itself: its key head's q and k channels (2 x key_dim channels of K taps, the
same in each of the key head's GROUP x blocks programs: about 4 KB more a program, from L2 after the first)
and its own value columns' channels. With 4 warps that is 127 registers a thread for sm_90, no spills (the rule's
kernel alone: 114).

Who writes what (the invariant that keeps the convolution state free of races): a value column's channels are
read and written by one program, its own, which shifts them in after its read. A key head's q and k channels are
read by every program of that (row, key head), in any order on a GPU, so none of them may shift them in while
another may still read the old window: each program counts itself in arrivals[row * key_heads + key_head] after
its reads and stores (kernels/triton/arrivals.py), and only the last to arrive, which every other has passed,
writes the shifted q and k window, from the window it read itself before any write. Rows hold distinct slots, so
no two rows share a state.

The norm needs each head's sum of squares over all its value_dim outputs, which several programs compute: each
stores its o columns rounded to the model's dtype (the norm's first rounding) in the output row, and the same
last program loads the key head's GROUP heads back (past its L1: other programs' stores) and overwrites them with
the gated norm (norm_then_gate): one program forms each sum from the rounded values, as gated_rms_norm's does, so
the result does not depend on the order the programs finish. That tail (GROUP x value_dim outputs, 256 in
Qwen3-Next) is the only work done after the slowest program of a key head.

A row whose slot is negative (a CUDA graph's padding row) reads and writes no state; it counts and leaves its
counts at 0 like any row; its outputs are meaningless and never read. Launched with dependent launch
(kernels/triton/pdl.py): a program loads its slot, its state cells, its convolution windows and the layer's
weights before the wait, which pdl.py's rule allows (only this layer's step writes its pools, in an earlier step;
the step's slots are copied in before its first kernel), and the projections' outputs and the counts after it.
out_proj comes next: it is placed at this launch's start (pdl.py's early launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardserve.kernels.triton import pdl
from shardserve.kernels.triton.arrivals import arrival_counts, last_to_arrive, leave
from shardserve.kernels.triton.causal_conv1d import channels_step, loaded_channels, shift_in
from shardserve.kernels.triton.gated_delta_rule import VALUE_BLOCK, gate_inputs, step_columns
from shardserve.kernels.triton.gated_rms_norm import norm_then_gate
from shardserve.kernels.triton.pdl import enter, launch_next


@triton.jit
def _norm_heads(out_at, z_at, w, eps, GROUP: tl.constexpr, DV: tl.constexpr, DV_POW2: tl.constexpr):
    """Overwrites the GROUP heads' o at out_at (the model's dtype, stored by other programs) with the gated norm of
    weight w (float32 [DV_POW2], zeros past DV). Every head's o and z are loaded before the first store, so the
    tail after the arrival waits on one round trip, not one a head; each head is then normed as the gated norm's
    kernel norms it (the same bits)."""
    cols = tl.arange(0, DV_POW2)
    inside = cols < DV
    o_rows = ()
    z_rows = ()
    for i in tl.static_range(GROUP):
        o_rows = o_rows + (tl.load(out_at + i * DV + cols, mask=inside, other=0.0, cache_modifier=".cg"),)
        z_rows = z_rows + (tl.load(z_at + i * DV + cols, mask=inside, other=0.0),)
    for i in tl.static_range(GROUP):
        out = norm_then_gate(o_rows[i].to(tl.float32), z_rows[i].to(tl.float32), w, eps, DV, out_at.dtype.element_ty)
        tl.store(out_at + i * DV + cols, out.to(out_at.dtype.element_ty), mask=inside)


@triton.jit
def _step_norm_kernel(qkv_ptr, ba_ptr, z_ptr, conv_weight_ptr, a_log_ptr, dt_bias_ptr, norm_weight_ptr,
                      conv_pool_ptr, rec_pool_ptr, slots_ptr, counts_ptr, out_ptr, scale, eps, stride_qkv,
                      stride_ba, stride_z, stride_conv_slot, stride_rec_slot, key_heads, value_heads,
                      GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DK_POW2: tl.constexpr,
                      DV_POW2: tl.constexpr, BV: tl.constexpr, KERNEL: tl.constexpr, TAPS: tl.constexpr,
                      PDL: tl.constexpr, NEXT_EARLY: tl.constexpr = False):
    if NEXT_EARLY:
        launch_next(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    keys = tl.arange(0, DK_POW2)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    key_in, col_in = keys < DK, cols < DV
    q_channels = key_head * DK + keys
    k_channels = q_channels + key_heads * DK
    v_channels = 2 * key_heads * DK + head * DV + cols
    # Before the wait (pdl.py's rule): the slot (copied in before the step's first kernel), the states (only this
    # layer's step writes them, in an earlier step) and the weights.
    slot = tl.load(slots_ptr + row)
    live = slot >= 0
    conv_row = conv_pool_ptr + slot.to(tl.int64) * stride_conv_slot
    q_loaded = loaded_channels(conv_row, conv_weight_ptr, None, q_channels, key_in, live, KERNEL, TAPS)
    k_loaded = loaded_channels(conv_row, conv_weight_ptr, None, k_channels, key_in, live, KERNEL, TAPS)
    v_loaded = loaded_channels(conv_row, conv_weight_ptr, None, v_channels, col_in, live, KERNEL, TAPS)
    cells = (rec_pool_ptr + slot.to(tl.int64) * stride_rec_slot + head * DK * DV + keys[:, None] * DV
             + cols[None, :])
    cell = key_in[:, None] & col_in[None, :] & live
    s = tl.load(cells, mask=cell, other=0.0)
    a_log, dt_bias = tl.load(a_log_ptr + head), tl.load(dt_bias_ptr + head)
    norm_cols = tl.arange(0, DV_POW2)
    norm_weight = tl.load(norm_weight_ptr + norm_cols, mask=norm_cols < DV, other=0.0).to(tl.float32)
    enter(PDL, NEXT_EARLY)
    x_row = qkv_ptr + row * stride_qkv
    q_window, q = channels_step(x_row, q_loaded, q_channels, key_in, KERNEL, TAPS)
    k_window, k = channels_step(x_row, k_loaded, k_channels, key_in, KERNEL, TAPS)
    v_window, v = channels_step(x_row, v_loaded, v_channels, col_in, KERNEL, TAPS)
    shift_in(conv_row, v_channels, v_window, col_in & live, KERNEL, TAPS)  # no other program reads these
    b, a = gate_inputs(ba_ptr + row * stride_ba, head, value_heads)
    s, o = step_columns(q, k, v, b, a, a_log, dt_bias, s, scale)
    tl.store(cells, s, mask=cell)
    group_out = out_ptr + (row * value_heads + key_head * GROUP) * DV
    tl.store(out_ptr + (row * value_heads + head) * DV + cols, o.to(out_ptr.dtype.element_ty), mask=col_in)
    count = row * key_heads + key_head
    if last_to_arrive(counts_ptr, count, GROUP * tl.num_programs(2)):
        # Every program of this key head has read the q and k window: it may move now.
        shift_in(conv_row, q_channels, q_window, key_in & live, KERNEL, TAPS)
        shift_in(conv_row, k_channels, k_window, key_in & live, KERNEL, TAPS)
        _norm_heads(group_out, z_ptr + row * stride_z + key_head * GROUP * DV, norm_weight, eps, GROUP, DV,
                    DV_POW2)
        leave(counts_ptr, count)


def step_and_norm_in_pool(qkv: torch.Tensor, ba: torch.Tensor, z: torch.Tensor, conv_weight: torch.Tensor,
                          a_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          scale: float, key_heads: int, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                          slots: torch.Tensor, value_block: int = VALUE_BLOCK, num_warps: int = 4
                          ) -> torch.Tensor | None:
    """One token of each of B sequences from the input projections' outputs to the gated norm's: qkv [B, channels]
    ([q | k | v] before the convolution), ba [B, 2 * value_heads] ([b | a]), z [B, value_heads * dv] (rows may be
    strided, features unit-strided); conv_weight [channels, K] contiguous; a_log, dt_bias float32 [value_heads];
    norm_weight [dv] in the model's dtype; conv_pool [slots, channels, K - 1] and rec_pool float32 [slots,
    value_heads, dk, dv], each slot contiguous (written in place); slots int64 [B], distinct. Returns [B,
    value_heads * dv] in norm_weight's dtype, or None where the device's arrival counts are too few for B x
    key_heads or not made yet inside a CUDA graph capture (the caller then takes the three kernels). value_block,
    num_warps: the launch's shape, value columns a program owns and its warps (the model runs the defaults;
    benchmarks/deltanet_decode.py --shapes times others)."""
    rows = qkv.shape[0]
    value_heads, dk, dv = rec_pool.shape[1:]
    out = torch.empty(rows, value_heads * dv, dtype=norm_weight.dtype, device=qkv.device)
    if rows == 0:
        return out
    counts = arrival_counts(qkv.device, rows * key_heads)
    if counts is None:
        return None
    if qkv.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError("step_and_norm_in_pool needs qkv's and z's features unit-strided")
    kernel = conv_weight.shape[1]
    block = min(value_block, triton.next_power_of_2(dv))
    grid = (rows, value_heads, triton.cdiv(dv, block))
    _step_norm_kernel[grid](qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, conv_pool, rec_pool, slots, counts,
                            out, scale, eps, qkv.stride(0), ba.stride(0), z.stride(0), conv_pool.stride(0),
                            rec_pool.stride(0), key_heads, value_heads, GROUP=value_heads // key_heads, DK=dk, DV=dv,
                            DK_POW2=triton.next_power_of_2(dk), DV_POW2=triton.next_power_of_2(dv), BV=block,
                            KERNEL=kernel, TAPS=triton.next_power_of_2(kernel), num_warps=num_warps,
                            **pdl.launch(qkv.device, next_early=True))
    return out
