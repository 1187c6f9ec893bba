"""The kernel plan: every numeric choice of one launch, decided once and the same on every rank.

A plan says in which dtype the model computes, which linear kernels may run (in order of preference),
and, once start-up has checked and timed them, which linear kernel, attention backend, all-reduce method
and batch-1 GEMVs are used. It is decided from the CPU's instruction-set flags (kernels/cpu_features.py),
the checkpoint's dtype, the serve config and the SHARDSERVE_* overrides; the flags and overrides are part
of the start-up fingerprint, and the finished plan is compared across ranks before serving
(engine/kernel_setup.py), so two ranks can never compute one model two ways.

On CPUs `--dtype auto` computes in float32 whatever the checkpoint: every matmul accumulates and every
activation is kept in float32, so a request's tokens do not depend on how many others share its batch or
on how many ranks split its layers (bfloat16 activations round each partial result, and the rounding
differs with the kernel a batch size or a shard width picks). A bfloat16 checkpoint keeps its weights in
bfloat16 for single-token steps and a GGUF-quantized one its 4- or 8-bit blocks (exact, both: the float32
copy for batches holds the same values).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shardserve import envs
from shardserve.config import DTYPES, EngineConfig, ModelConfig
from shardserve.kernels.cpu_features import CpuFeatures

LINEAR_KERNEL_ENV = envs.LINEAR_KERNEL.name
LINEAR_KERNELS = envs.LINEAR_KERNEL.choices
# Variables that force a choice the plan would otherwise make itself; each one in effect is shown in the plan.
OVERRIDE_ENV = envs.plan_override_names()


class KernelPlanError(ValueError):
    """The plan cannot be made or kept: a bad override, or no kernel passed its start-up check."""


@dataclass(frozen=True)
class KernelPlan:
    device: str
    dtype: torch.dtype  # activations, KV cache and (except the bfloat16 copies of bf16-decode) weights
    linear_candidates: tuple[str, ...]  # in order of preference; the first that passes on every rank is used
    cpu: str = ""  # CpuFeatures.describe() for CPU ranks
    overrides: tuple[str, ...] = ()  # "NAME=value" of each override in effect
    # Filled in by start-up, after the kernels were checked and timed:
    linear: str = ""
    attention: str = ""
    all_reduce: str = ""
    gemv: str = ""
    dependent_launch: str = ""  # Triton kernels launched to overlap the one before (kernels/triton/pdl.py)
    delta_net: str = ""  # Gated DeltaNet kernels (layers/deltanet_kernels.py), on hybrid models
    mamba2: str = ""  # Mamba-2 kernels (layers/mamba2_kernels.py), on NemotronH
    quantized: str = ""  # packed quantized layers (layers/quantization/), e.g. "fp8 (...) packed on 96 layers"

    def with_results(self, **fields: str) -> "KernelPlan":
        return dataclasses.replace(self, **fields)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        parts = [f"{self.device} {dtype}", f"linear {self.linear or '/'.join(self.linear_candidates)}"]
        parts += [f"{name} {value}" for name, value in
                  (("attention", self.attention), ("all-reduce", self.all_reduce), ("batch-1 GEMV", self.gemv),
                   ("dependent launch", self.dependent_launch), ("Gated DeltaNet", self.delta_net),
                   ("Mamba-2", self.mamba2),
                   ("quantized", self.quantized))
                  if value]
        if self.cpu:
            parts.append(f"cpu {self.cpu}")
        if self.overrides:
            parts.append("overrides " + " ".join(self.overrides))
        return "; ".join(parts)


def overrides_in_effect() -> tuple[str, ...]:
    return tuple(f"{name}={envs.REGISTRY[name].raw()}" for name in OVERRIDE_ENV if envs.REGISTRY[name].is_set())


def compute_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if config.device == "cpu":
        return torch.float32  # see the module docstring
    return model_config.checkpoint_dtype()


def linear_candidates(device: str, dtype: torch.dtype, model_config: ModelConfig,
                      features: CpuFeatures | None) -> tuple[str, ...]:
    try:
        forced = envs.LINEAR_KERNEL.get()
    except ValueError as e:
        raise KernelPlanError(str(e)) from None
    if forced:
        if device != "cpu" and forced != "torch":
            raise KernelPlanError(f"{LINEAR_KERNEL_ENV}={forced} runs on CPUs only; on {device} use torch")
        return (forced,)
    if device != "cpu":
        return ("torch",)  # cuBLAS; batch-1 Triton GEMVs are chosen per shape after loading (layers/cuda_gemv.py)
    if dtype == torch.float32:
        avx2 = features is not None and features.avx2_fma
        gptq = model_config.quantization is not None and model_config.quantization.method == "gptq"
        if avx2 and (model_config.quantized or gptq):
            # GGUF blocks (or a symmetric GPTQ's groups), recovered exactly where they are
            return ("blockq-decode", "onednn-packed", "torch")
        if avx2 and model_config.checkpoint_dtype() == torch.bfloat16:
            return ("bf16-decode", "onednn-packed", "torch")
        return ("onednn-packed", "torch")
    if dtype == torch.bfloat16:
        return ("onednn-packed", "torch")
    return ("torch",)


def decide(config: EngineConfig, model_config: ModelConfig, features: CpuFeatures | None) -> KernelPlan:
    """The plan before loading: what every rank derives from the same config, flags and overrides."""
    dtype = compute_dtype(config, model_config)
    return KernelPlan(device=config.device, dtype=dtype,
                      linear_candidates=linear_candidates(config.device, dtype, model_config, features),
                      cpu=features.describe() if features is not None else "",
                      overrides=overrides_in_effect())
