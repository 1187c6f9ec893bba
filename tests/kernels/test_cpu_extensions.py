"""The CPU extensions: a first start's build, about a minute of silence otherwise, is announced; a build torch
has cached is loaded without a word; a build older than its source is announced again."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

from torch.utils import cpp_extension

from shardserve.kernels import cpu_extensions

ANNOUNCED = ("first start: building the CPU kernel bf16_gemv_cpu.cpp, about a minute (cached afterwards: later "
             "starts load it in a second)")


def test_a_first_build_is_announced_and_a_cached_one_is_not(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_extensions.cpu_features, "detect", lambda: SimpleNamespace(avx2_fma=True))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    library = tmp_path / "shardserve_bf16_gemv_cpu" / "shardserve_bf16_gemv_cpu.so"

    def build(name, sources, **options):  # what torch leaves behind, without the compiler's minute
        library.write_bytes(b"")
        return SimpleNamespace(name=name)

    monkeypatch.setattr(cpp_extension, "load", build)

    def start() -> list[str]:
        cpu_extensions._build.cache_clear()  # a new process
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=cpu_extensions.__name__):
            cpu_extensions.build_for(("bf16-decode", "onednn-packed", "torch"))
        return [r.getMessage() for r in caplog.records]

    try:
        assert start() == [ANNOUNCED]
        assert start() == [], "a cached build is loaded silently"
        os.utime(library, (0, 0))  # built before its source last changed: ninja compiles it again
        assert start() == [ANNOUNCED]
    finally:
        cpu_extensions._build.cache_clear()
