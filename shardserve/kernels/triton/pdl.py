"""Programmatic dependent launch (Hopper and newer): a kernel starts while the one before it finishes.

A batch-1 decode step is a chain of about nine kernels a layer, each waiting for the previous one to end
before its programs are even scheduled. With programmatic dependent launch the next kernel's programs are
placed on the GPU as soon as every program of the current one has passed `enter`, and wait there for the
current kernel's memory: the launch and the scheduling of programs leave the critical path. On two H100s
this took a Llama-3-8B-shaped TP=2 batch-1 step from 3.34 to 3.23 ms (docs/benchmarks-notebook.md); prefetching the
GEMVs' first weight lines into L2 during the wait made it slower, loading their first tile into registers
faster at TP=2 (gemv.preload_tiles).

Rules every kernel launched this way follows (`enter` does both):
  - it waits (griddepcontrol.wait) before reading anything the kernel just before it may have written and
    before writing anything: the wait returns once the previous kernel has completed and its memory is
    visible, and since that kernel waited in turn, once every earlier kernel has;
  - it lets its dependents launch only after that wait, so at most one kernel runs ahead of the chain.
So when a kernel's programs start, every kernel two or more launches back has completed: before its wait a
kernel may read what no kernel of the chain writes (weights, tables of addresses) and what only such earlier
kernels wrote (the batch-1 GEMV's first weight tiles, the peer all-reduce's counters).
Early launches, the exception: a kernel lets the next one launch at its start (launch_next, then enter with
LAUNCHED) where that next kernel's prologue, what it reads before its wait, reads nothing any kernel of the step
writes (weights, the step's inputs copied in before its first kernel, state that only that same kernel wrote in an
earlier step). The next kernel's programs are then placed while this one runs and do their scheduling, their
prologue and their setup off the critical path. Several kernels may run ahead that way, so the "two launches back"
above weakens to: when a kernel's programs are placed, every kernel before the nearest earlier kernel that let its
next launch after its own wait has completed. A prologue that reads what the chain wrote must count back to such a
kernel (fp4_products.fp4_experts' x_early, the expert down kernels' choices, the all-reduce's counters). The
early launches (SHARDSERVE_NEXT_EARLY=on, the default; off: none of these):
  - the RMSNorm kernel where the caller says a linear layer's product comes next (RMSNorm.forward's next_early);
  - the router's choice (moe_router, grouped_router): the experts' kernels follow, whose prologues read weights, or
    with x_early the norm's output, three launches back behind the router's GEMV, which enters normally;
  - the state mixers' decode steps (Mamba-2, Gated DeltaNet): out_proj follows;
  - the CUDA fp4 GEMV of a layer whose output no collective takes (column-parallel, or whole on the rank:
    linear.KernelLinear.feeds_next_directly): a state step, attention, a norm or another product follows; a
    row-parallel layer's all-reduce is not placed early.
Not every early placement pays: the Triton FP8 GEMVs launched early (a column-parallel layer's GEMV letting the
next one, a state step or attention launch at its start) took a Qwen3-Next FP8 step from 2.228 to 2.272 ms
(docs/benchmarks-notebook.md, 2026-12-01), so they keep to the rule above.
And SHARDSERVE_ATTENTION_OVERLAP (on by default): where the o projection's GEMV loads all its weight rows before
its wait and all its programs fit on the GPU at once (layers/attention.overlap_with_o_projection,
cuda_gemv.holds_rows), decode attention and its split combine let it launch at their start: its weights stream
while attention, which reads little from memory, runs.
Without the launch attribute (other GPUs, SHARDSERVE_PDL=off) the same kernels run as before: the wait returns
at once.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from shardserve import envs

MODES = envs.PDL.choices


@triton.jit
def enter(PDL: tl.constexpr, LAUNCHED: tl.constexpr = False):
    """Wait for the kernels before this one, then let the next one launch (a no-op without PDL); with LAUNCHED the
    kernel let it launch already (launch_next)."""
    if PDL:
        gdc_wait()
        if not LAUNCHED:
            gdc_launch_dependents()


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next kernel launch before this one's wait: only where that kernel reads nothing the chain writes
    before its own wait (the module docstring's exception); the kernel then enters with LAUNCHED."""
    if PDL:
        gdc_launch_dependents()


ATTENTION_OVERLAP_ENV = envs.ATTENTION_OVERLAP.name


def attention_overlap() -> bool:
    """Whether the o projection may load its rows while decode attention runs (the module docstring's exception;
    SHARDSERVE_ATTENTION_OVERLAP=on, the default; off: never, and attention lets it launch after its wait)."""
    return envs.ATTENTION_OVERLAP.get() == "on"


def launches_next_early(device: torch.device, wanted: bool = True) -> bool:
    """Whether a kernel on `device` that `wanted` to let the next one launch at its start does: with dependent
    launch active and the early launches of the module docstring on (SHARDSERVE_NEXT_EARLY=on, the default)."""
    return wanted and active(device) and envs.NEXT_EARLY.get() == "on"


def mode() -> str:
    return envs.PDL.get()


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def supported(device: torch.device) -> bool:
    """Whether `device` has the dependent-launch instructions (a GPU of compute capability 9.0 or newer, not
    Triton's interpreter), whatever SHARDSERVE_PDL says."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def active(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch."""
    return mode() != "off" and supported(device)


def describe(device: torch.device) -> str:
    """For the kernel plan."""
    if not active(device):
        return "off" if mode() == "off" or device.type != "cuda" else "off (needs compute capability 9.0)"
    return "on"


def launch(device: torch.device, next_early: bool | None = None) -> dict:
    """The keyword arguments of a kernel launch that takes a PDL constexpr: the constexpr and the attribute; with
    `next_early` (for a kernel that takes a NEXT_EARLY constexpr) whether it lets the next launch at its start
    (launches_next_early)."""
    on = active(device)
    args = {"PDL": on, "launch_pdl": on} if on else {"PDL": False}
    if next_early is not None:
        args["NEXT_EARLY"] = launches_next_early(device, next_early)
    return args
