"""The start-up check of the Mamba-2 kernels: it passes the torch and Triton kernels (float32 and bfloat16 SSM
states), catches kernels that are wrong in a way a user would see (the skip D or dt_bias forgotten, a padding
row's slot -1 stepping the pool's last slot inside a graph), and start-up then serves with the torch kernels,
saying so, or stops where those fail too."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardserve.engine import kernel_setup  # noqa: E402
from shardserve.kernels.plan import KernelPlanError  # noqa: E402
from shardserve.kernels.self_check import check_mamba2  # noqa: E402
from shardserve.layers.mamba2 import Mamba2Dims, Mamba2Mixer  # noqa: E402
from shardserve.layers.mamba2_kernels import (TorchMamba2Kernels, TritonDecodeMamba2Kernels,  # noqa: E402
                                              TritonFusedDecodeMamba2Kernels)
from tests.triton_interpreter import convert_float32_to_bfloat16_nearest  # noqa: E402

SINGLE = SimpleNamespace(rank=0, world_size=1, is_driver=True)
CPU = torch.device("cpu")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# heads, groups, head_dim, state_size, conv_kernel, chunk_size, time_step_limit, conv_bias
SIZES = (4, 2, 12, 10, 4, 8, (0.05, 0.8), True)


_TRITON_STEP = TritonDecodeMamba2Kernels.step_in_pool


def _ignores_d(xbc, dt, conv_weight, conv_bias, a_log, d, *rest):
    return _TRITON_STEP(xbc, dt, conv_weight, conv_bias, a_log, d * 0, *rest)


class IgnoresD(TritonDecodeMamba2Kernels):
    """Decode steps without the skip connection D x."""

    name = "ignores-D"
    step_in_pool = staticmethod(_ignores_d)


class IgnoresDtBias(TritonDecodeMamba2Kernels):
    """Decode steps that take softplus(dt) without the bias."""

    name = "ignores-dt-bias"

    @staticmethod
    def step_in_pool(xbc, dt, conv_weight, conv_bias, a_log, d, dt_bias, *rest):
        return _TRITON_STEP(xbc, dt, conv_weight, conv_bias, a_log, d, dt_bias * 0, *rest)


class FusedIgnoresEps(TritonFusedDecodeMamba2Kernels):
    """The one-kernel decode step with the norm's eps taken as 1: only its decode steps are wrong."""

    name = "fused-ignores-eps"

    @classmethod
    def step_and_norm_in_pool(cls, xbc, dt, z, conv_weight, conv_bias, a_log, d, dt_bias, time_step_limit, groups,
                              norm_weight, group_size, eps, *pools):
        return super().step_and_norm_in_pool(xbc, dt, z, conv_weight, conv_bias, a_log, d, dt_bias,
                                             time_step_limit, groups, norm_weight, group_size, 1.0, *pools)


class StepsThePaddingSlot(TorchMamba2Kernels):
    """The torch step claiming to be graph-safe: a padding row's slot -1 steps the pool's last slot."""

    name = "steps-the-padding-slot"
    graph_safe = True


@pytest.mark.parametrize("kernels, dtype, ssm_dtype", [
    (TorchMamba2Kernels(), torch.float32, torch.float32),
    (TritonDecodeMamba2Kernels(), torch.float32, torch.float32),
    (TritonDecodeMamba2Kernels(), torch.bfloat16, torch.bfloat16),
    (TritonFusedDecodeMamba2Kernels(), torch.bfloat16, torch.float32),
], ids=["torch", "triton", "triton-bf16", "triton-fused-bf16"])
def test_the_check_passes_the_kernels(kernels, dtype, ssm_dtype, monkeypatch):
    if kernels.graph_safe:
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "1":
            convert_float32_to_bfloat16_nearest(monkeypatch)
    result = check_mamba2(kernels, *SIZES, dtype, ssm_dtype, DEVICE if kernels.graph_safe else CPU)
    assert result.passed, result.describe()


@pytest.mark.parametrize("kernels", [IgnoresD(), IgnoresDtBias(), FusedIgnoresEps(), StepsThePaddingSlot()],
                         ids=lambda k: k.name)
def test_the_check_fails_wrong_kernels_and_names_them(kernels):
    pytest.importorskip("triton")
    result = check_mamba2(kernels, *SIZES, torch.float32, torch.float32, DEVICE)
    assert not result.passed and result.error > result.tolerance and "Error" not in result.detail
    assert result.describe().startswith(f"{kernels.name} Mamba-2 (4x12 heads in 2 groups, state 10, conv 4")


def _model(kernels) -> nn.Module:
    dims = Mamba2Dims(32, 4, 12, 10, 2, 4, 8, 1e-5, (0.05, 0.8))
    comm = SimpleNamespace(rank=0, world_size=1)
    return nn.ModuleList([Mamba2Mixer(dims, comm, torch.float32, kernels=kernels) for _ in range(2)])


def test_start_up_replaces_failing_triton_kernels_by_torch_on_every_layer_with_a_warning(caplog, monkeypatch):
    """Triton kernels that fail their check leave the layers on torch, which also keeps them out of CUDA graphs."""
    pytest.importorskip("triton")
    monkeypatch.setattr(TritonDecodeMamba2Kernels, "step_in_pool", staticmethod(_ignores_d))
    model = _model(TritonDecodeMamba2Kernels()).to(DEVICE)
    assert all(layer.graph_safe for layer in model)
    with caplog.at_level(logging.WARNING):
        name = kernel_setup.checked_mamba2(model, torch.float32, torch.float32, DEVICE, SINGLE)
    assert name == "torch"
    assert all(type(layer.kernels) is TorchMamba2Kernels and not layer.graph_safe for layer in model)
    assert "Mamba-2 kernels triton decode failed their start-up check, using torch instead" in caplog.text


def test_start_up_stops_when_the_torch_kernels_fail_too(monkeypatch):
    monkeypatch.setattr(TorchMamba2Kernels, "scan", staticmethod(lambda x, dt, a, b, c, d, state, chunk_size:
                                                                 (x.float() * 0, state.float())))
    with pytest.raises(KernelPlanError, match="no Mamba-2 kernels passed their start-up check"):
        kernel_setup.checked_mamba2(_model(TorchMamba2Kernels()), torch.float32, torch.float32, CPU, SINGLE)


def test_a_model_without_such_layers_has_nothing_to_check():
    assert kernel_setup.checked_mamba2(nn.Linear(2, 2), torch.float32, torch.float32, CPU, SINGLE) == ""
