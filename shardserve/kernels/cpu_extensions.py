"""Builds (once, cached by torch under ~/.cache/torch_extensions) and loads the AVX2 CPU kernels:

- bf16_gemv_cpu.cpp: float32 activations times bfloat16 weights (the bf16-decode linear kernel);
- blockq_gemv_cpu.cpp: float32 activations times weights in 4- and 8-bit blocks of 32, GGUF style (the
  blockq-decode linear kernel).
"""

from __future__ import annotations

import functools
import glob
import logging
import os

from shardserve.kernels import cpu_features

logger = logging.getLogger(__name__)

HERE = os.path.dirname(__file__)
# The linear kernels (kernels/plan.py LINEAR_KERNELS) that run one of these extensions.
SOURCES = {"bf16-decode": "bf16_gemv_cpu.cpp", "blockq-decode": "blockq_gemv_cpu.cpp"}


@functools.cache
def _build(source: str):
    """The compiled module, or None where it cannot be built (no compiler, no AVX2)."""
    if not cpu_features.detect().avx2_fma:
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        name = "shardserve_" + source.removesuffix(".cpp")
        path = os.path.join(HERE, source)
        if not _built_already(name, path):
            logger.info("first start: building the CPU kernel %s, about a minute (cached afterwards: later starts "
                        "load it in a second)", source)
        return load_extension(name, [path], extra_cflags=["-O3", "-mavx2", "-mfma"], extra_include_paths=[HERE],
                              verbose=False)
    except Exception as e:  # noqa: BLE001 - a missing compiler must not stop serving
        logger.warning("CPU kernel %s unavailable, using float32 weights instead: %s", source, e)
        return None


def _built_already(name: str, source: str) -> bool:
    """Whether torch's extension cache holds `name` built after its source and headers last changed (else ninja
    compiles it, as it would then)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        library = os.path.join(_get_build_directory(name, verbose=False), f"{name}.so")
        inputs = [source, *glob.glob(os.path.join(HERE, "*.h"))]
        return os.path.getmtime(library) >= max(os.path.getmtime(p) for p in inputs)
    except (ImportError, OSError):  # no such library yet (or a torch that keeps it elsewhere)
        return False


def build_for(linear_kernels: tuple[str, ...]) -> None:
    """Build (or load from the cache) the extensions these linear kernels need, before any is checked."""
    for kernel in linear_kernels:
        if kernel in SOURCES:
            _build(SOURCES[kernel])


def bf16_gemv():
    return _build(SOURCES["bf16-decode"])


def blockq_gemv():
    return _build(SOURCES["blockq-decode"])
