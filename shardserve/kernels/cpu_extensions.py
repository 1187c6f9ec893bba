"""Builds (once, cached by torch under ~/.cache/torch_extensions) and loads the AVX2 CPU kernels:

- bf16_gemv_cpu.cpp: float32 activations times bfloat16 weights (the bf16-decode linear kernel);
- blockq_gemv_cpu.cpp: float32 activations times weights in 4- and 8-bit blocks of 32, GGUF style (the
  blockq-decode linear kernel).
"""

from __future__ import annotations

import functools
import logging
import os

from shardserve.kernels import cpu_features

logger = logging.getLogger(__name__)


@functools.cache
def _build(source: str):
    """The compiled module, or None where it cannot be built (no compiler, no AVX2)."""
    if not cpu_features.detect().avx2_fma:
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        name = "shardserve_" + source.removesuffix(".cpp")
        here = os.path.dirname(__file__)
        return load_extension(name, [os.path.join(here, source)], extra_cflags=["-O3", "-mavx2", "-mfma"],
                              extra_include_paths=[here], verbose=False)
    except Exception as e:  # noqa: BLE001 - a missing compiler must not stop serving
        logger.warning("CPU kernel %s unavailable, using float32 weights instead: %s", source, e)
        return None


def bf16_gemv():
    return _build("bf16_gemv_cpu.cpp")


def blockq_gemv():
    return _build("blockq_gemv_cpu.cpp")
