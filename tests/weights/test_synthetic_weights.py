"""Synthetic weights (`load_format="dummy"`) stand in for a real checkpoint of the same model: the same
tensor names and shapes, reproducible from a seed, and the same model at every tensor-parallel size."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from shardserve.cli import build_parser
from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.entrypoints.llm import LLM
from shardserve.models import model_class
from shardserve.requests.sampling_params import SamplingParams
from shardserve.weights.loader import safetensors_files
from shardserve.weights.loader import load_synthetic_weights
from shardserve.weights.synthetic import iter_synthetic_checkpoint
from tests.tiny_models import TINY_SPECS

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


def _synthetic(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return dict(iter_synthetic_checkpoint(cfg, "cpu", dtype, seed))


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_names_and_shapes_are_those_of_the_real_checkpoint(tiny_model_dir, name):
    model_dir = tiny_model_dir(name)
    cfg = ModelConfig.from_model_path(model_dir)
    synthetic = _synthetic(cfg, dtype=torch.bfloat16)
    assert {n: tuple(t.shape) for n, t in synthetic.items()} == _checkpoint_shapes(model_dir)
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in synthetic.values())

    # Every rank of a sharded model finds a place for each tensor and gets all its parameters.
    for rank, world in ((0, 1), (0, 2), (1, 2), (2, 3)):
        model = model_class(cfg.architecture)(cfg, Communicator(None, rank, world), torch.float32, max_positions=64)
        load_synthetic_weights(model, cfg, "cpu", torch.float32)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_values_are_reproducible_from_the_seed(tiny_model_dir):
    cfg = ModelConfig.from_model_path(tiny_model_dir("qwen2"))  # has q/k/v biases
    first, again, other = _synthetic(cfg, seed=0), _synthetic(cfg, seed=0), _synthetic(cfg, seed=1)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in first)
    # Every tensor gets its own values, not a copy of another of the same shape.
    assert not torch.equal(first["model.layers.0.self_attn.q_proj.weight"],
                           first["model.layers.1.self_attn.q_proj.weight"])
    # The dtype changes only the precision.
    half = _synthetic(cfg, seed=0, dtype=torch.bfloat16)
    assert all(torch.equal(half[n], first[n].to(torch.bfloat16)) for n in first)

    # Hugging Face's initialisation scale: std 0.02 around 0, norm weights around 1.
    embed = first["model.embed_tokens.weight"]
    assert embed.mean().abs() < 0.002 and embed.std().item() == pytest.approx(0.02, rel=0.05)
    norm = first["model.layers.0.input_layernorm.weight"]
    assert norm.mean().item() == pytest.approx(1.0, abs=0.01)
    assert first["model.layers.0.self_attn.q_proj.bias"].abs().max() > 0


def test_dummy_engine_generates_the_same_tokens_at_tp1_and_tp2(tiny_model_dir):
    model_dir = tiny_model_dir("llama-untied")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (7, 20, 1)]
    outputs = {}
    for tp in (1, 2):
        with LLM(model_dir, tensor_parallel_size=tp, load_format="dummy", dtype="float32",
                 kv_cache_memory_gb=0.05) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outputs[2] == outputs[1]
    assert all(len(t) == GREEDY.max_tokens for t in outputs[1])
    assert len({t for tokens in outputs[1] for t in tokens}) > 3, "random weights should not collapse to one token"

    with LLM(model_dir, load_format="auto", dtype="float32", kv_cache_memory_gb=0.05) as real:
        from_checkpoint = [o.token_ids for o in real.generate(prompts, GREEDY)]
    assert from_checkpoint != outputs[1], "dummy weights must not be read from the checkpoint"


def test_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy, got 'dumy'"):
        EngineConfig(model="m", load_format="dumy")


def test_serve_flag_names_the_choices(capsys):
    args = build_parser().parse_args(["serve", "model-dir", "--load-format", "dummy"])
    assert args.load_format == "dummy"
    assert build_parser().parse_args(["serve", "model-dir"]).load_format == "auto"
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "model-dir", "--load-format", "random"])
    assert exit_info.value.code == 2
    assert "argument --load-format: invalid choice: 'random' (choose from 'auto', 'dummy')" in capsys.readouterr().err
