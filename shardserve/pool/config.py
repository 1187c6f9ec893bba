"""The pool's configuration file: which models share the machine's devices, and how much memory they may use.

    memory_budget_gb: 120        # device memory the awake models may hold together (default: no limit)
    api_key: sk-...              # optional: clients must send `Authorization: Bearer <api_key>` (--api-key wins)
    models:
      - name: llama-8b           # the `model` clients ask for
        model: /models/Llama-3-8B
        memory_gb: 60            # what this model holds awake (weights + KV cache), per device
        tensor_parallel_size: 1
        gpus: [0]                # optional: the devices it uses (CUDA_VISIBLE_DEVICES); default all
        ttl_s: 600               # optional: sleep after this long without requests
        args: ["--max-num-seqs", "128"]   # optional: more `shardserve serve` flags

Errors name the key (`models.1.memory_gb: ...`). Relative model paths are relative to this file; each is
checked when the pool starts (a missing path or tokenizer is an error then, not at the first request).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from shardserve.model_files import ModelPathError, check_model_path, relative_to_file
from shardserve.yaml_config import load_yaml_model


def check_api_key(key: str) -> str:
    """`key`, if a client can send it in an `Authorization: Bearer` header as it is."""
    if not key or key != key.strip():
        raise ValueError("the API key must not be empty nor begin or end with whitespace, which an "
                         "Authorization header drops")
    return key


class PoolModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    memory_gb: float = Field(gt=0)
    tensor_parallel_size: int = Field(default=1, ge=1)
    gpus: list[int] | None = None
    ttl_s: float | None = Field(default=None, gt=0)
    args: list[str] = Field(default_factory=list)

    @field_validator("args")
    @classmethod
    def _no_pool_owned_flags(cls, args: list[str]) -> list[str]:
        clash = sorted({c for c in map(_pool_owned_flag, args) if c is not None})
        if clash:
            raise ValueError(f"{', '.join(clash)} are set by the pool, not in args")
        return args


# Flags of `shardserve serve` the pool sets itself (the API key through the environment, out of `ps`).
POOL_OWNED_FLAGS = ("--port", "--host", "--served-model-name", "-tp", "--tensor-parallel-size", "--api-key")


def _pool_owned_flag(arg: str) -> str | None:
    """The pool-owned flag `arg` sets, as argparse reads it: whole, as --flag=value, or abbreviated."""
    name = arg.split("=", 1)[0]
    if name in POOL_OWNED_FLAGS:
        return name
    if name.startswith("--") and len(name) > 2:
        flag = next((f for f in POOL_OWNED_FLAGS if f.startswith(name)), None)
        return None if flag is None else f"{name} ({flag})"
    return None


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[PoolModel] = Field(min_length=1)
    memory_budget_gb: float | None = Field(default=None, gt=0)
    api_key: str | None = Field(default=None, repr=False)  # kept out of reprs, so out of logs and tracebacks
    _source: str = PrivateAttr(default="the pool config")  # the file it was read from, for errors

    @field_validator("api_key")
    @classmethod
    def _sendable_api_key(cls, key: str | None) -> str | None:
        return None if key is None else check_api_key(key)

    @model_validator(mode="after")
    def _names_unique_and_each_fits(self) -> "PoolConfig":
        names = [m.name for m in self.models]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"model names must be unique, repeated: {', '.join(duplicated)}")
        if self.memory_budget_gb is not None:
            too_big = [m.name for m in self.models if m.memory_gb > self.memory_budget_gb]
            if too_big:
                raise ValueError(f"memory_gb of {', '.join(too_big)} exceeds memory_budget_gb "
                                 f"{self.memory_budget_gb:g}: it could never be awake")
        return self


class PoolConfigError(ValueError):
    pass


def load_pool_config(path: str) -> PoolConfig:
    config = load_yaml_model(path, PoolConfig, PoolConfigError, "pool config")
    for m in config.models:
        m.model = relative_to_file(m.model, path)
    config._source = path
    return config


def check_model_paths(config: PoolConfig) -> None:
    """Every model's path holds what `shardserve serve` needs: checked when the pool starts, before any model
    does, rather than when one first starts (maybe at a request, much later)."""
    for i, m in enumerate(config.models):
        try:
            check_model_path(m.model, _load_format(m.args))
        except ModelPathError as e:
            raise PoolConfigError(f"{config._source}: models.{i} ({m.name}): {e}") from None


def _load_format(args: list[str]) -> str:
    for i, arg in enumerate(args):
        if arg.startswith("--load-format="):
            return arg.split("=", 1)[1]
        if arg == "--load-format" and i + 1 < len(args):
            return args[i + 1]
    return "auto"
