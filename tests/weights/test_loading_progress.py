"""The loading bar: on a terminal it counts every tensor of every shard file; elsewhere it stays quiet."""

from __future__ import annotations

import io
import logging
import sys

import torch
from rich.console import Console
from safetensors import safe_open

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.models.llama import LlamaForCausalLM
from shardserve.weights import loader


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_reaches_every_tensor_of_a_sharded_checkpoint(tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama-untied")  # saved over several safetensors files
    files = loader.safetensors_files(model_dir)
    assert len(files) > 1
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    assert loader.count_checkpoint_tensors(model_dir) == total

    screen = io.StringIO()
    monkeypatch.setattr(loader, "progress_console", lambda: Console(file=screen, force_terminal=True, color_system=None,
                                                                     width=120))
    cfg = ModelConfig.from_model_path(model_dir)
    model = LlamaForCausalLM(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    loader.load_weights(model, model_dir, cfg.tie_word_embeddings)
    assert f"{total}/{total} tensors" in screen.getvalue()
    assert "loading llama-untied" in screen.getvalue()


def test_bar_only_on_a_terminal_with_info_logged(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert loader.progress_console() is None, "stderr is not a terminal"

    monkeypatch.setattr(sys, "stderr", _Terminal())
    shardserve_logger = logging.getLogger("shardserve")
    level = shardserve_logger.level
    try:
        shardserve_logger.setLevel(logging.INFO)
        assert loader.progress_console() is not None
        shardserve_logger.setLevel(logging.WARNING)  # --log-level warning
        assert loader.progress_console() is None
    finally:
        shardserve_logger.setLevel(level)
