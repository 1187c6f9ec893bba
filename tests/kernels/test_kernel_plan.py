"""The kernel plan: capability detection from instruction-set flags (mocked CPUs), and the choices made
from them, the checkpoint and the overrides."""

from __future__ import annotations

import pytest
import torch

from shardserve.config import EngineConfig, ModelConfig
from shardserve.kernels import cpu_features
from shardserve.kernels import plan as kernel_plan
from shardserve.kernels.cpu_features import CpuFeatures, parse_cpuinfo_flags

# The flags lines of the two CPUs this project meets most, cut to what matters here.
XEON_WITHOUT_BF16 = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni"
EPYC_WITH_BF16 = "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 fma avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
AVX2_ONLY = "flags\t\t: fpu sse2 avx avx2 fma"


def _features(cpuinfo: str, cap: str | None = None) -> CpuFeatures:
    return CpuFeatures(frozenset(f for f in parse_cpuinfo_flags(cpuinfo) if f in cpu_features.FLAGS), cap)


@pytest.mark.parametrize("cpuinfo, cap, native", [
    (XEON_WITHOUT_BF16, None, False),  # AVX-512 alone: oneDNN would only emulate bfloat16
    (EPYC_WITH_BF16, None, True),
    (SAPPHIRE_RAPIDS, None, True),
    (AVX2_ONLY, None, False),
    (EPYC_WITH_BF16, "AVX512_CORE", False),  # capped below the bfloat16 instructions
    (EPYC_WITH_BF16, "AVX512_CORE_BF16", True),
    (SAPPHIRE_RAPIDS, "AVX512_CORE_AMX", True),
    (SAPPHIRE_RAPIDS, "AVX2", False),
])
def test_native_bfloat16_comes_from_the_isa_flags_and_the_onednn_cap(cpuinfo, cap, native):
    features = _features(cpuinfo, cap)
    assert features.fast_bfloat16 is native
    assert ("not native" not in features.describe()) is native


def test_detect_reads_proc_cpuinfo_and_the_cap_variable(monkeypatch, set_env):
    monkeypatch.setattr(cpu_features, "read_flags", lambda: parse_cpuinfo_flags(XEON_WITHOUT_BF16))
    cpu_features._detect_cached.cache_clear()
    set_env(ONEDNN_MAX_CPU_ISA=None)
    set_env(DNNL_MAX_CPU_ISA=None)
    try:
        assert cpu_features.detect().describe() == "avx2 fma avx512f avx512bw (bfloat16 not native)"
        monkeypatch.setattr(cpu_features, "read_flags", lambda: parse_cpuinfo_flags(EPYC_WITH_BF16))
        cpu_features._detect_cached.cache_clear()
        set_env(ONEDNN_MAX_CPU_ISA="avx512_core")
        detected = cpu_features.detect()
        assert detected.isa_cap == "AVX512_CORE" and not detected.fast_bfloat16
        assert "oneDNN capped at AVX512_CORE" in detected.describe()
    finally:
        cpu_features._detect_cached.cache_clear()


def _model_config(torch_dtype: str, quantized: bool = False) -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100, "torch_dtype": torch_dtype,
        "gguf_quantized": quantized})


@pytest.mark.parametrize("cpuinfo", [XEON_WITHOUT_BF16, EPYC_WITH_BF16, AVX2_ONLY])
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32"])
def test_cpus_compute_in_float32_under_auto_whatever_the_cpu(cpuinfo, checkpoint):
    plan = kernel_plan.decide(EngineConfig(model="m", device="cpu"), _model_config(checkpoint), _features(cpuinfo))
    assert plan.dtype == torch.float32


def test_only_exact_bfloat16_weights_get_the_bfloat16_decode_kernel(set_env):
    set_env({kernel_plan.LINEAR_KERNEL_ENV: None})
    config, avx2 = EngineConfig(model="m", device="cpu"), _features(AVX2_ONLY)
    assert kernel_plan.decide(config, _model_config("bfloat16"), avx2).linear_candidates == (
        "bf16-decode", "onednn-packed", "torch")
    # float16 values are not exact in bfloat16: their weights stay float32.
    assert kernel_plan.decide(config, _model_config("float16"), avx2).linear_candidates == ("onednn-packed", "torch")
    # Nor are dequantized GGUF values: they keep their own blocks for decoding.
    assert kernel_plan.decide(config, _model_config("bfloat16", quantized=True), avx2).linear_candidates == (
        "blockq-decode", "onednn-packed", "torch")
    # The bfloat16 extension needs AVX2 and FMA.
    assert "bf16-decode" not in kernel_plan.decide(config, _model_config("bfloat16"),
                                                   CpuFeatures(frozenset())).linear_candidates
    bf16 = kernel_plan.decide(EngineConfig(model="m", device="cpu", dtype="bfloat16"), _model_config("bfloat16"),
                              _features(EPYC_WITH_BF16))
    assert bf16.dtype == torch.bfloat16 and bf16.linear_candidates == ("onednn-packed", "torch")


def test_gpus_keep_the_checkpoint_dtype_under_auto():
    plan = kernel_plan.decide(EngineConfig(model="m", device="cuda"), _model_config("bfloat16"), None)
    assert plan.dtype == torch.bfloat16 and plan.linear_candidates == ("torch",) and plan.cpu == ""


def test_a_forced_linear_kernel_is_the_only_candidate_and_shows_in_the_plan(set_env):
    set_env({kernel_plan.LINEAR_KERNEL_ENV: "torch"})
    plan = kernel_plan.decide(EngineConfig(model="m", device="cpu"), _model_config("bfloat16"),
                              _features(EPYC_WITH_BF16))
    assert plan.linear_candidates == ("torch",)
    assert "overrides SHARDSERVE_LINEAR_KERNEL=torch" in plan.describe()


def test_an_unknown_forced_kernel_is_refused_naming_the_variable_and_the_choices(set_env):
    set_env({kernel_plan.LINEAR_KERNEL_ENV: "mkl"})
    with pytest.raises(kernel_plan.KernelPlanError) as e:
        kernel_plan.decide(EngineConfig(model="m", device="cpu"), _model_config("float32"), _features(AVX2_ONLY))
    assert "SHARDSERVE_LINEAR_KERNEL='mkl'" in str(e.value)
    assert "bf16-decode, blockq-decode, onednn-packed, torch" in str(e.value)


def test_the_plan_line_names_every_choice():
    plan = kernel_plan.decide(EngineConfig(model="m", device="cpu"), _model_config("bfloat16"),
                              _features(XEON_WITHOUT_BF16))
    line = plan.with_results(linear="bf16-decode", attention="torch-sdpa", all_reduce="shm <= 512 KiB, gloo").describe()
    assert line.startswith("cpu float32; linear bf16-decode; attention torch-sdpa; all-reduce shm <= 512 KiB, gloo")
    assert "avx512f" in line and "bfloat16 not native" in line
