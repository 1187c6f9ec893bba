"""The CUDA C timing probes in benchmarks/ (*.cu files, not kernels the engine runs): each is compiled after the
package's shardserve/kernels/cuda/fp4_products.cu text, whose Chunk, loads and sums it uses, by NVRTC for Hopper."""

from __future__ import annotations

import functools
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def probe_source(*files: str, edits=()) -> str:
    """fp4_products.cu's text, then each of `files` (in benchmarks/), with `edits` ((text, replacement) pairs, each
    text present) made: probes leave out or change a part of a kernel by editing its source."""
    from shardserve.kernels.cuda import fp4_products, runtime

    source = runtime._source(fp4_products.SOURCE) + "".join(open(os.path.join(HERE, f)).read() for f in files)
    for old, new in edits:
        if old not in source:
            raise ValueError(f"probe edit not found: {old}")
        source = source.replace(old, new)
    return source


@functools.cache
def compiled(source: str, filename: str, expression: str):
    """The kernel template instance `expression` of `source`, compiled for sm_90a and loaded, once per source and
    instance (filename: the name NVRTC's messages give it)."""
    from shardserve.kernels.cuda import runtime

    return runtime.Kernel(*runtime.compile_cubin(source, filename, "sm_90a", expression))


def kernel_parameters(source: str, kernel: str) -> list[str]:
    """The parameter names of `kernel` as `source` declares them."""
    head = source[source.index(f"{kernel}("):]
    params = head[head.index("(") + 1:head.index(")")]
    return [p.strip().split()[-1].lstrip("*") for p in params.split(",")]
