"""Recipes: a model's serve settings in one YAML file instead of a drifting shell script.

    model: /models/Llama-3-8B
    tensor_parallel_size: 2
    serve:                        # any `shardserve serve` option, by its flag name with underscores
      max_model_len: 8192
      max_num_seqs: 128
    env: {NCCL_DEBUG: WARN}       # set on the launching node, and forwarded to every rank
    forward_env: [NCCL_IB_HCA]    # forwarded from the launching node as they are there
    nodes: [10.0.0.1, 10.0.0.2]   # optional: the machines, node 0 first (gives --nnodes, --master-addr)

`shardserve serve --recipe FILE` and `shardserve plan --recipe FILE` take it; flags given on the
command line override it. A relative `model` path (and a draft model's, in `speculative_config`) is relative to the recipe file. Unknown keys and bad values are refused with their path and what is accepted.
"""

from __future__ import annotations

import dataclasses

import os
import re
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shardserve.model_files import relative_to_file
from shardserve.yaml_config import load_yaml_model


class ServeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: Literal["cpu", "cuda"] | None = None
    host: str | None = None
    port: int | None = Field(default=None, gt=0, lt=65536)
    served_model_name: str | None = None
    max_model_len: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    kv_cache_memory: float | None = Field(default=None, gt=0)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    block_size: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool | None = None
    api_key: str | None = None
    max_request_body_mb: float | None = Field(default=None, gt=0)
    seed: int | None = None
    load_format: Literal["auto", "dummy"] | None = None
    enforce_eager: bool | None = None
    max_restarts: int | None = Field(default=None, ge=0)
    wake_on_request: bool | None = None
    control_interface: str | None = None
    master_port: int | None = Field(default=None, gt=0, lt=65536)
    enable_expert_parallel: bool | None = None
    quantization: Literal["fp8"] | None = None
    mamba_ssm_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] | None = None
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3"] | None = None
    # --speculative-config's JSON as a mapping, checked by config.SpeculativeConfig.
    speculative_config: dict[str, Any] | None = None
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "generic", "none"] | None = None
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    api_server_count: int | None = Field(default=None, ge=0)
    data_parallel_size: int | None = Field(default=None, gt=0)
    data_parallel_routing: Literal["affinity", "least-loaded", "round-robin"] | None = None
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    log_level: Literal["debug", "info", "warning", "error"] | None = None


    @field_validator("speculative_config")
    @classmethod
    def _checked_speculative_config(cls, value: dict[str, Any] | None):
        from shardserve.config import SpeculativeConfig

        return None if value is None else SpeculativeConfig.from_dict(value)


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    tensor_parallel_size: int = Field(default=1, gt=0)
    pipeline_parallel_size: int = Field(default=1, gt=0)
    serve: ServeOptions = Field(default_factory=ServeOptions)
    env: dict[str, str] = Field(default_factory=dict)
    forward_env: list[str] = Field(default_factory=list)
    nodes: list[str] | None = Field(default=None, min_length=1)


class RecipeError(ValueError):
    pass


def load_recipe(path: str) -> Recipe:
    recipe = load_yaml_model(path, Recipe, RecipeError, "recipe")
    bad = [n for n in [*recipe.env, *recipe.forward_env] if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
    if bad:
        raise RecipeError(f"{path}: env/forward_env: not variable names: {', '.join(bad)}")
    recipe.model = relative_to_file(recipe.model, path)
    spec = recipe.serve.speculative_config
    if spec is not None and spec.model is not None:  # a draft model's path, relative to the recipe as `model` is
        recipe.serve.speculative_config = dataclasses.replace(spec, model=relative_to_file(spec.model, path))
    return recipe


def recipe_defaults(recipe: Recipe) -> dict[str, Any]:
    """The recipe as argparse defaults (dest -> value); command-line flags still override them."""
    values: dict[str, Any] = {"model": recipe.model, "tensor_parallel_size": recipe.tensor_parallel_size,
                              "pipeline_parallel_size": recipe.pipeline_parallel_size}
    values.update({k: v for k, v in recipe.serve.model_dump().items() if v is not None})
    forwarded = list(dict.fromkeys([*recipe.env, *recipe.forward_env]))
    if forwarded:
        values["forward_env"] = forwarded
    if recipe.nodes and len(recipe.nodes) > 1:
        values["nnodes"] = len(recipe.nodes)
        values["master_addr"] = recipe.nodes[0]
        here = _this_node(recipe.nodes)
        if here is not None:
            values["node_rank"] = here
    return values


def apply_recipe_env(recipe: Recipe) -> None:
    """Set the recipe's variables on this (the launching) node unless already set here."""
    for name, value in recipe.env.items():
        os.environ.setdefault(name, value)


def _this_node(nodes: list[str]) -> int | None:
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return next((i for i, node in enumerate(nodes) if node in names), None)
