"""Asking L2 for bytes a later kernel will read, without waiting for them (Hopper's bulk prefetch).

A one-token expert product reads its weights once, a few megabytes a launch, and the launch after it (the w2
product, whose experts the same router chose) cannot start streaming until its programs are placed. The w13
programs know those experts once they pass their wait, so each can ask L2 for a share of the w2 rows while its
own rows stream (fused_moe's PREFETCH_ROWS): HBM then works through both products' bytes in the time of the
first. A request is one instruction of one thread a program (cp.async.bulk.prefetch.L2.global); nothing is
written, nothing waits, and an evicted line is read again from memory, so it never changes a result.

Measured on two H200s (Qwen3-Next-80B-A3B FP8 blocks, batch-1 graph replay, one process a setting and card):
2.237, 2.274 and 2.262 ms on one card and 2.282 and 2.275 on the other with the requests, against 2.300 and 2.287 on
the first and 2.286, 2.306 and 2.290 on the other without (the w2 launch 6.4 us exposed a layer against 6.7 to 7.3
without), so FP8 experts take them
by default (SHARDSERVE_MOE_PREFETCH_DOWN=off: never); the greedy tokens are the same. The 4-bit experts do not:
Nemotron-3-Nano NVFP4 took 1.678 and 1.682 ms with them against 1.618 and 1.619, its w2 (22 MB a layer, as much as
w13) crowding L2 while w13 streams. Asking for the w13 rows of a later wave of programs instead (84 or 168 tiles
ahead) was slower still: 2.38 to 2.41 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptr, nbytes):
    """Asks L2 for nbytes from ptr (ptr 16-byte aligned, nbytes a multiple of 16; 0: nothing), once a program."""
    tl.inline_asm_elementwise(
        """{
        .reg .u32 t;
        .reg .pred p;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        setp.ne.and.u32 p, $2, 0, p;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, stride_e, stride_n, expert, program, ROWS: tl.constexpr, ROW_BYTES: tl.constexpr,
                  NUM_ROWS: tl.constexpr):
    """Asks L2 for rows [program * ROWS, + ROWS) (those under NUM_ROWS) of expert `expert`'s block of w [E, NUM_ROWS,
    ...] (strides in elements; a row ROW_BYTES bytes, contiguous with the next: rows_prefetch's checks)."""
    first = program * ROWS
    rows = tl.minimum(NUM_ROWS - first, ROWS)
    prefetch_l2(w_ptr + expert.to(tl.int64) * stride_e + first.to(tl.int64) * stride_n,
                tl.maximum(rows, 0) * ROW_BYTES)


def rows_prefetch(w: torch.Tensor, programs: int) -> dict:
    """prefetch_rows' arguments for `programs` programs sharing each expert's rows of w [E, N, ...], or {} where its
    rows are not contiguous 16-byte-aligned runs."""
    if w.dim() < 3:
        return {}
    row_bytes = w[0, 0].numel() * w.element_size()
    if not (w[0, 0].is_contiguous() and w.stride(1) * w.element_size() == row_bytes
            and w.stride(0) == w.shape[1] * w.stride(1) and row_bytes % 16 == 0 and w.data_ptr() % 16 == 0):
        return {}
    return dict(w2_ptr=w, stride_w2e=w.stride(0), stride_w2n=w.stride(1), W2_ROW_BYTES=row_bytes,
                PREFETCH_ROWS=triton.cdiv(w.shape[1], programs), W2_ROWS=w.shape[1])
