"""Recipes: validated with their path and the accepted values; command-line flags override them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shardserve.cli import parse_args
from shardserve.pool.config import PoolConfigError, load_pool_config
from shardserve.recipes import RecipeError, load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _recipe(tmp_path, data: dict) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_the_example_recipes_are_valid():
    files = sorted(RECIPES.glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        if "pool" in path.name:
            assert len(load_pool_config(str(path)).models) == 2
        else:
            assert load_recipe(str(path)).tensor_parallel_size in (2, 8)


@pytest.mark.parametrize("serve, message", [
    ({"max_num_seq": 8}, r"serve\.max_num_seq: Extra inputs are not permitted"),
    ({"max_num_seqs": "many"}, r"serve\.max_num_seqs: Input should be a valid integer"),
    ({"gpu_memory_utilization": 1.5}, r"serve\.gpu_memory_utilization: Input should be less than or equal to 1"),
    ({"device": "tpu"}, r"serve\.device: Input should be 'cpu' or 'cuda'"),
])
def test_bad_recipes_are_refused_with_the_path_and_what_is_accepted(tmp_path, serve, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(_recipe(tmp_path, {"model": "/m", "serve": serve}))


def test_flags_override_the_recipe_and_env_is_forwarded(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDSERVE_RECIPE_PROBE", raising=False)
    path = _recipe(tmp_path, {"model": "/models/m", "tensor_parallel_size": 2,
                              "serve": {"max_num_seqs": 32, "device": "cpu", "seed": 7},
                              "env": {"SHARDSERVE_RECIPE_PROBE": "1"}, "forward_env": ["NCCL_DEBUG"]})
    args = parse_args(["serve", "--recipe", path, "--max-num-seqs", "8", "--forward-env", "GLOO_DEBUG"])
    assert (args.model, args.tensor_parallel_size, args.max_num_seqs, args.device, args.seed) == \
        ("/models/m", 2, 8, "cpu", 7)
    assert args.forward_env == ["SHARDSERVE_RECIPE_PROBE", "NCCL_DEBUG", "GLOO_DEBUG"]
    assert os.environ["SHARDSERVE_RECIPE_PROBE"] == "1"
    assert parse_args(["serve", "/other", "--recipe", path]).model == "/other", "a MODEL argument wins too"


def test_nodes_give_nnodes_and_master_addr(tmp_path):
    path = _recipe(tmp_path, {"model": "/m", "tensor_parallel_size": 8, "nodes": ["10.9.0.1", "10.9.0.2"]})
    args = parse_args(["serve", "--recipe", path, "--node-rank", "1"])
    assert (args.nnodes, args.master_addr, args.node_rank) == (2, "10.9.0.1", 1)


def test_plan_takes_a_recipe_and_a_bad_one_is_a_cli_error(tmp_path):
    config_dir = tmp_path / "model"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
                                            '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, '
                                            '"max_position_embeddings": 512, "torch_dtype": "float32"}')
    path = _recipe(tmp_path, {"model": str(config_dir), "tensor_parallel_size": 2, "serve": {"max_model_len": 256}})
    result = subprocess.run([sys.executable, "-m", "shardserve", "plan", "--recipe", path, "--gpu-memory-gb", "4"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "per rank (tensor parallel 2)" in result.stdout and "at 256 tokens" in result.stdout
    bad = _recipe(tmp_path, {"model": "/m", "serve": {"max_num_seq": 1}})
    result = subprocess.run([sys.executable, "-m", "shardserve", "serve", "--recipe", bad], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert "--recipe:" in result.stderr and "serve.max_num_seq: Extra inputs are not permitted" in result.stderr


def test_a_relative_model_path_is_relative_to_the_recipe_not_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    path = tmp_path / "recipes" / "r.yaml"
    path.write_text(yaml.safe_dump({"model": "../models/m.gguf", "tensor_parallel_size": 2}))
    monkeypatch.chdir("/")
    assert load_recipe(str(path)).model == str(tmp_path / "models" / "m.gguf")
    assert load_recipe(str(RECIPES / "smollm2-tp2-cpu.yaml")).model == str(
        RECIPES.parent / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_a_recipe_can_set_every_serve_option():
    """Each `serve` flag has its place in a recipe: under serve:, or as the recipe's own model,
    tensor_parallel_size, forward_env or nodes (which give nnodes, node_rank and master_addr)."""
    from shardserve.cli import build_parser
    from shardserve.recipes import Recipe, ServeOptions

    serve = build_parser().get_default("subparsers")["serve"]
    flags = {action.dest for action in serve._actions} - {"help", "recipe"}
    by_nodes = {"nnodes", "node_rank", "master_addr"}
    assert flags - by_nodes - set(Recipe.model_fields) == set(ServeOptions.model_fields)


def test_a_mixture_of_experts_recipe(tmp_path):
    path = _recipe(tmp_path, {"model": "/models/Qwen3-30B-A3B", "tensor_parallel_size": 2,
                              "serve": {"enable_expert_parallel": True, "reasoning_parser": "qwen3",
                                        "tool_call_parser": "hermes"}})
    args = parse_args(["serve", "--recipe", path])
    assert (args.enable_expert_parallel, args.reasoning_parser, args.tool_call_parser) == (True, "qwen3", "hermes")
    with pytest.raises(RecipeError, match=r"serve\.reasoning_parser: Input should be 'qwen3' or 'deepseek_r1'"):
        load_recipe(_recipe(tmp_path, {"model": "/m", "serve": {"reasoning_parser": "think"}}))


@pytest.mark.parametrize("load, error, what", [(load_recipe, RecipeError, "recipe"),
                                               (load_pool_config, PoolConfigError, "pool config")])
def test_a_missing_unparsable_or_empty_file_is_one_line_naming_it(tmp_path, load, error, what):
    cases = [("missing.yaml", None, "cannot read the {what} {path}: No such file or directory"),
             ("broken.yaml", "model: [unclosed\n", "{path} is not valid YAML"),
             ("empty.yaml", "", "{path}: (model|models): Field required"),
             ("list.yaml", "- a\n- b\n", r"{path}: \(top level\): Input should be a valid dictionary")]
    for name, text, message in cases:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(error, match=message.format(what=what, path=re.escape(str(path)))):
            load(str(path))


def test_a_recipe_sets_speculative_decoding_and_names_a_bad_setting(tmp_path):
    path = _recipe(tmp_path, {"model": "/m", "serve": {"speculative_config": {"method": "ngram",
                                                                             "num_speculative_tokens": 2}}})
    args = parse_args(["serve", "--recipe", path])
    from shardserve.config import EngineConfig, SpeculativeConfig

    assert EngineConfig(model="/m", speculative_config=args.speculative_config).speculative_config == \
        SpeculativeConfig("ngram", 2)
    with pytest.raises(RecipeError, match="serve.speculative_config.*method 'eagle' is not supported yet"):
        load_recipe(_recipe(tmp_path, {"model": "/m", "serve": {"speculative_config": {
            "method": "eagle", "num_speculative_tokens": 1}}}))


def test_a_recipes_draft_model_path_is_relative_to_the_recipe(tmp_path):
    """`speculative_config.model` is read as `model` is: relative to the recipe's folder, whatever the current
    directory."""
    path = _recipe(tmp_path, {"model": "target", "serve": {"speculative_config": {
        "method": "draft_model", "model": "drafts/small", "num_speculative_tokens": 2}}})
    recipe = load_recipe(path)
    assert recipe.model == str(tmp_path / "target")
    assert recipe.serve.speculative_config.model == str(tmp_path / "drafts" / "small")
