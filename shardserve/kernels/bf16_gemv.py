"""Builds (once, cached by torch under ~/.cache/torch_extensions) and loads bf16_gemv_cpu.cpp."""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)


@functools.cache
def load():
    """The compiled module, or None where it cannot be built (no compiler, no AVX2)."""
    if not _cpu_has_avx2_fma():
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        source = os.path.join(os.path.dirname(__file__), "bf16_gemv_cpu.cpp")
        return load_extension("shardserve_bf16_gemv_cpu", [source], extra_cflags=["-O3", "-mavx2", "-mfma"],
                              verbose=False)
    except Exception as e:  # noqa: BLE001 - a missing compiler must not stop serving
        logger.warning("bfloat16 CPU kernel unavailable, using float32 weights instead: %s", e)
        return None


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags
