"""Programmatic dependent launch (Hopper and newer): a kernel starts while the one before it finishes.

A batch-1 decode step is a chain of about nine kernels a layer, each waiting for the previous one to end
before its programs are even scheduled. With programmatic dependent launch the next kernel's programs are
placed on the GPU as soon as every program of the current one has passed `enter`, and wait there for the
current kernel's memory; the GEMVs use that time to prefetch their first weight columns into L2, so
weight streaming goes on behind the latency-bound kernels between them (the all-reduce, attention, rotary).

Rules every kernel launched this way follows (`enter` does the first two):
  - it waits (griddepcontrol.wait) before reading anything an earlier kernel wrote and before writing
    anything: the wait returns once the previous kernel has completed and its memory is visible, and since
    that kernel waited in turn, once every earlier kernel has;
  - it lets its dependents launch only after that wait, so at most one kernel runs ahead of the chain;
  - what it reads before the wait never changes during a step (weights).
Without the launch attribute (other GPUs, SHARDSERVE_PDL=off) the same kernels run as before: the wait returns
at once. SHARDSERVE_PDL_PREFETCH_KB sets each GEMV program's prefetch (0: none).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MODES = ("auto", "on", "off")
DEFAULT_PREFETCH_KB = 16
LINE_BYTES = 128


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernels before this one, then let the next one launch (a no-op without PDL)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(w_rows, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):
    """Ask L2 for the first LINES cache lines of each row at pointers w_rows ([rows, 1]); no registers are filled."""
    lines = w_rows + tl.arange(0, LINES)[None, :] * LINE_ELEMS
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [lines], dtype=tl.int32,
                              is_pure=False, pack=1)


def mode() -> str:
    value = os.environ.get("SHARDSERVE_PDL", "auto")
    if value not in MODES:
        raise ValueError(f"SHARDSERVE_PDL={value!r}: expected one of {', '.join(MODES)}")
    return value


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def active(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch."""
    if device.type != "cuda" or mode() == "off":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def describe(device: torch.device) -> str:
    """For the kernel plan."""
    if not active(device):
        return "off" if mode() == "off" or device.type != "cuda" else "off (needs compute capability 9.0)"
    kb = int(os.environ.get("SHARDSERVE_PDL_PREFETCH_KB", DEFAULT_PREFETCH_KB))
    return f"on, GEMVs prefetch {kb} KiB a program" if kb > 0 else "on, no prefetch"


def launch(device: torch.device) -> dict:
    """The keyword arguments of a kernel launch that takes a PDL constexpr: the constexpr and the attribute."""
    on = active(device)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


def prefetch_lines(device: torch.device, weight: torch.Tensor, block_n: int, row_bytes: int | None = None) -> int:
    """Cache lines of each of its rows a GEMV program prefetches before waiting: about
    SHARDSERVE_PDL_PREFETCH_KB a program, within the row (`row_bytes`, default the weight's), a power of two;
    0 without PDL."""
    if not active(device):
        return 0
    kb = int(os.environ.get("SHARDSERVE_PDL_PREFETCH_KB", DEFAULT_PREFETCH_KB))
    row_bytes = row_bytes if row_bytes is not None else weight.shape[1] * weight.element_size()
    lines = min(kb * 1024 // (block_n * LINE_BYTES), row_bytes // LINE_BYTES)
    return 0 if lines < 1 else 1 << (lines.bit_length() - 1)


def streaming(weight: torch.Tensor, block_n: int, row_bytes: int | None = None) -> dict:
    """launch()'s arguments plus a weight-streaming kernel's PREFETCH (lines a row) and LINE_ELEMS."""
    return dict(launch(weight.device), PREFETCH=prefetch_lines(weight.device, weight, block_n, row_bytes),
                LINE_ELEMS=max(1, LINE_BYTES // weight.element_size()))
