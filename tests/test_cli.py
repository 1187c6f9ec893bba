"""The command line refuses bad flags with a message naming the flag and what it accepts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardserve.distributed.process_group import find_free_port

SERVING_DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve", "serve", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args, expected", [
    (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4' (choose from 'auto', 'float32', 'bfloat16', 'float16')"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu' (choose from 'cpu', 'cuda')"),
    (["-tp", "0"], "--tensor-parallel-size takes a positive integer, got 0"),
    (["--max-model-len", "ten"], "--max-model-len takes a positive integer, got 'ten'"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory takes a positive number, got -1.0"),
    (["--mamba-ssm-cache-dtype", "fp8"], "argument --mamba-ssm-cache-dtype: invalid choice: 'fp8' (choose from "
                                         "'auto', 'float32', 'float16', 'bfloat16')"),
])
def test_bad_flag_is_named_with_accepted_values(tmp_path, args, expected):
    result = _serve(str(tmp_path), *args)
    assert result.returncode == 2
    assert expected in result.stderr


def test_missing_model_is_named(tmp_path):
    result = _serve(str(tmp_path / "nowhere.gguf"), "--port", str(find_free_port()))
    assert result.returncode != 0
    assert "nowhere.gguf" in result.stderr and "does not exist" in result.stderr


def test_version():
    result = subprocess.run([sys.executable, "-m", "shardserve", "--version"], capture_output=True, text=True)
    from shardserve import __version__

    assert result.stdout.strip() == f"shardserve {__version__}"


def test_a_port_in_use_is_named_before_anything_loads(tiny_model_dir):
    """The port is taken first: a clash is reported at once, naming the flags, not after loading the model."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve(tiny_model_dir("llama-untied"), "--device", "cpu", "--port", str(port), "-tp", "2")
    assert result.returncode != 0
    assert f"--host 127.0.0.1 --port {port}: Address already in use" in result.stderr, result.stderr[-2000:]
    assert "loaded" not in result.stderr, "the model was loaded before the port was checked"


def test_abbreviated_flags_are_refused_not_guessed():
    import pytest

    from shardserve.cli import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "m.gguf", "--tensor-parallel", "2"])
    assert exit_info.value.code == 2
    assert parse_args(["serve", "m.gguf", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_the_serving_synopsis_shows_every_serve_flag_with_its_choices():
    """docs/serving.md's "Serving options" synopsis names each flag `shardserve serve` takes (one of its
    spellings), and a flag's accepted values as `--flag a|b|c`, in the parser's order: a flag added to the CLI
    fails here until the documentation shows it."""
    from shardserve.cli import build_parser

    section = SERVING_DOC.read_text().split("## Serving options", 1)[1]
    synopsis = section.split("```", 2)[1]
    serve = build_parser().get_default("subparsers")["serve"]
    missing = []
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        shown = [flag for flag in action.option_strings if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", synopsis)]
        if not shown:
            missing.append("/".join(action.option_strings))
        elif action.choices and not any(f"{flag} {'|'.join(action.choices)}" in synopsis for flag in shown):
            missing.append(f"{shown[0]} {'|'.join(action.choices)}")
    assert not missing, f"docs/serving.md's serving options synopsis lacks {', '.join(missing)}"
