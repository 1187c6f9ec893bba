"""A model path that cannot be served is refused before anything loads, in one line naming what is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from shardserve.model_files import ModelPathError, check_model_path


def _serve(path: str) -> subprocess.CompletedProcess:
    from shardserve.distributed.process_group import find_free_port

    return subprocess.run([sys.executable, "-m", "shardserve", "serve", path, "--device", "cpu", "--port",
                           str(find_free_port())], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case, expected", [
    ("no tokenizer", "is missing a tokenizer (tokenizer.json, or tokenizer.model, or vocab.json with merges.txt)"),
    ("empty", "is missing config.json, *.safetensors weights and a tokenizer"),
    ("gguf folder", "is a directory of GGUF files: pass one of them"),
    ("absent", "does not exist"),
    ("unknown architecture", "unsupported model architecture ['GPTNeoXForCausalLM']"),
    ("awq", "quantization method 'awq' in config.json's quantization_config is not supported"),
])
def test_serve_names_what_the_model_path_lacks_in_one_line(tiny_model_dir, tmp_path, case, expected):
    path = tmp_path / "model"
    if case == "no tokenizer":
        shutil.copytree(tiny_model_dir("llama-tied"), path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).unlink()
    elif case == "empty":
        path.mkdir()
    elif case == "gguf folder":
        path.mkdir()
        (path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    elif case in ("unknown architecture", "awq"):
        import json

        shutil.copytree(tiny_model_dir("llama-tied"), path)
        config = json.loads((path / "config.json").read_text())
        if case == "awq":
            config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
        else:
            config["architectures"] = ["GPTNeoXForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))
    done = _serve(str(path))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_llm_refuses_it_too(tmp_path):
    from shardserve import LLM

    with pytest.raises(ModelPathError, match="is missing config.json"):
        LLM(str(tmp_path))


def test_synthetic_weights_need_no_safetensors(tiny_model_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama-tied"), path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    check_model_path(str(path), load_format="dummy")
    with pytest.raises(ModelPathError, match="missing \\*.safetensors weights"):
        check_model_path(str(path))
