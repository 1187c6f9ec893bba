"""What a model path must hold, checked before anything loads, with one line naming what is missing."""

from __future__ import annotations

import os
from pathlib import Path

# Files one of which makes a Hugging Face tokenizer loadable without converting a slow one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def relative_to_file(model: str, config_file: str) -> str:
    """A model path from a recipe or pool file: `~` expanded, and relative to that file's folder, not to the
    current directory, so the file works from anywhere."""
    here = os.path.dirname(os.path.abspath(config_file))
    return os.path.normpath(os.path.join(here, os.path.expanduser(model)))


class ModelPathError(ValueError):
    """A model path that cannot be served; the message is one line that says why."""


def check_model_path(path: str, load_format: str = "auto") -> None:
    """Raise ModelPathError unless `path` is a .gguf file or a model directory with config.json, a tokenizer
    and (unless the weights are synthetic, load_format "dummy") safetensors weights, whose architecture and
    quantization shardserve serves."""
    p = Path(path)
    if not p.exists():
        raise ModelPathError(f"model path {path!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelPathError(f"model path {path!r} is a file but not a .gguf file; pass a .gguf file or a "
                                 f"directory with config.json, *.safetensors and a tokenizer")
        _check_config(path)
        return
    ggufs = sorted(f.name for f in p.glob("*.gguf"))
    if ggufs and not (p / "config.json").is_file():
        shown = ", ".join(os.path.join(path, name) for name in ggufs[:3])
        raise ModelPathError(f"{path!r} is a directory of GGUF files: pass one of them ({shown})")
    missing = []
    if not (p / "config.json").is_file():
        missing.append("config.json")
    if load_format != "dummy" and not any(p.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json, or tokenizer.model, or vocab.json with merges.txt)")
    if missing:
        listed = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
        raise ModelPathError(f"model directory {path!r} is missing {listed}")
    _check_config(path)


def _check_config(path: str) -> None:
    """The config names an architecture and a quantization shardserve serves (one line where it does not)."""
    from shardserve.config import ModelConfig

    try:
        ModelConfig.from_model_path(path)
    except (ValueError, KeyError, OSError) as e:
        what = f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e)
        raise ModelPathError(f"{path}: {what}") from None
