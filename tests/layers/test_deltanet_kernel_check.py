"""The start-up check of the Gated DeltaNet kernels: it passes the torch and Triton kernels on odd and real head
sizes, catches kernels that are wrong in a way a user would see (a decay forgotten, a convolution tap off, a
one-kernel decode step gating by the wrong head or never moving its key heads' convolution window), and start-up
then serves with the simpler kernels they extend, saying so, or stops where the torch ones fail too."""

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
from shardserve.kernels.self_check import check_delta_net  # noqa: E402
from shardserve.layers.deltanet_kernels import (TorchDeltaNetKernels, TritonDecodeDeltaNetKernels,  # noqa: E402
                                                TritonFusedDecodeDeltaNetKernels)
from shardserve.layers.gated_deltanet import DeltaNetDims, GatedDeltaNet  # noqa: E402

SINGLE = SimpleNamespace(rank=0, world_size=1, is_driver=True)
CPU = torch.device("cpu")


class ForgetsTheDecay(TorchDeltaNetKernels):
    """Decode steps that never decay the state: outputs drift from the reference a little every token."""

    name = "forgets-the-decay"

    @staticmethod
    def step_in_pool(qkv, ba, conv_weight, a_log, dt_bias, scale, key_heads, conv_pool, rec_pool, slots):
        return TorchDeltaNetKernels.step_in_pool(qkv, ba, conv_weight, a_log - 50.0, dt_bias, scale, key_heads,
                                                 conv_pool, rec_pool, slots)


class ShiftedConvolution(TorchDeltaNetKernels):
    """A prompt's convolution one tap off (the newest input weighted by the oldest tap)."""

    name = "shifted-conv"

    @staticmethod
    def conv(x, weight, state):
        return TorchDeltaNetKernels.conv(x, weight.flip(-1), state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [(1, 3, 12, 20, 4), (2, 4, 16, 32, 4)])
def test_the_check_passes_the_torch_kernels(sizes, dtype):
    result = check_delta_net(TorchDeltaNetKernels(), *sizes, dtype, CPU)
    assert result.passed, result.describe()


@pytest.mark.parametrize("kernels", [TritonDecodeDeltaNetKernels(), TritonFusedDecodeDeltaNetKernels()],
                         ids=lambda k: k.name)
@pytest.mark.parametrize("sizes", [(1, 3, 12, 20, 4), (2, 4, 16, 32, 4)])
def test_the_check_passes_the_triton_decode_kernels(kernels, sizes):
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = check_delta_net(kernels, *sizes, torch.float32, device)
    assert result.passed, result.describe()


@pytest.mark.parametrize("kernels", [ForgetsTheDecay(), ShiftedConvolution()], ids=lambda k: k.name)
def test_the_check_fails_wrong_kernels_and_names_them(kernels):
    result = check_delta_net(kernels, 2, 4, 16, 32, 4, torch.float32, CPU)
    assert not result.passed
    assert result.describe().startswith(f"{kernels.name} Gated DeltaNet (2x16 key heads, 4x32 value heads")


def _model(kernels) -> nn.Module:
    dims = DeltaNetDims(32, 2, 4, 16, 32, 4, 1e-6)
    comm = SimpleNamespace(rank=0, world_size=1)
    return nn.ModuleList([GatedDeltaNet(dims, comm, torch.float32, kernels) for _ in range(2)])


def test_start_up_replaces_failing_kernels_by_torch_on_every_layer_with_a_warning(caplog):
    model = _model(ForgetsTheDecay())
    with caplog.at_level(logging.WARNING):
        name = kernel_setup.checked_delta_net(model, torch.float32, CPU, SINGLE)
    assert name == "torch"
    assert all(type(layer.kernels) is TorchDeltaNetKernels for layer in model)
    assert "Gated DeltaNet kernels forgets-the-decay failed their start-up check, using torch instead" in caplog.text


def test_start_up_stops_when_the_torch_kernels_fail_too(monkeypatch):
    monkeypatch.setattr(TorchDeltaNetKernels, "conv", ShiftedConvolution.conv)
    with pytest.raises(KernelPlanError, match="no Gated DeltaNet kernels passed their start-up check"):
        kernel_setup.checked_delta_net(_model(ForgetsTheDecay()), torch.float32, CPU, SINGLE)


def test_a_model_without_such_layers_has_nothing_to_check():
    assert kernel_setup.checked_delta_net(nn.Linear(2, 2), torch.float32, CPU, SINGLE) == ""


class BrokenPrefill(TritonDecodeDeltaNetKernels):
    """Decode steps right, prompts one convolution tap off: as a prefill kernel miscompiled for this GPU."""

    name = "broken-prefill"
    conv = staticmethod(ShiftedConvolution.conv)


def test_failing_prefill_kernels_give_way_to_the_decode_kernels_they_extend(caplog):
    """Only what failed is dropped: prompts go back to torch, decode steps keep the Triton kernels."""
    pytest.importorskip("triton")
    _assert_falls_back_to_triton_decode(_model(BrokenPrefill()), "broken-prefill", caplog)


def _assert_falls_back_to_triton_decode(model, failed: str, caplog) -> None:
    """The start-up check of `model`'s kernels (named `failed`) sets the three-kernel Triton decode on every layer
    and says so."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with caplog.at_level(logging.WARNING):
        name = kernel_setup.checked_delta_net(model.to(device), torch.float32, device, SINGLE)
    assert name == "triton decode"
    assert all(type(layer.kernels) is TritonDecodeDeltaNetKernels for layer in model)
    assert f"{failed} failed their start-up check, using triton decode instead" in caplog.text


def test_only_kernels_that_skip_padding_rows_let_cuda_graphs_capture_the_layer():
    """A CUDA graph's padding rows carry slot -1: the torch decode step would index the pools with it and step the
    last slot, which a live sequence may hold, so a layer on the torch kernels (a failed check's fallback, or
    Triton disabled) is not graph-safe and the engine decodes eagerly, naming why; the Triton step skips the row."""
    from shardserve.distributed.communicator import Communicator

    dims = DeltaNetDims(32, 2, 4, 8, 8, 4, 1e-6)
    layer = GatedDeltaNet(dims, Communicator(None, 0, 1), torch.float32, kernels=TorchDeltaNetKernels())
    assert layer.graph_safe is False and "torch" in layer.graph_unsafe_reason
    layer.kernels = TritonDecodeDeltaNetKernels()
    assert layer.graph_safe is True


def _gate_of_the_next_head(kernel):
    """The one-kernel decode step gating each head's norm by the next head's z, as a kernel reading z a head off."""
    def broken(qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, *rest):
        next_z = z.roll(-norm_weight.shape[0], dims=1)
        return kernel(qkv, ba, next_z, conv_weight, a_log, dt_bias, norm_weight, *rest)
    return broken


def _stuck_key_window(kernel):
    """The one-kernel decode step leaving the q and k channels' convolution state as it was, as a kernel whose key
    heads' last program never moves their window."""
    def broken(qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, eps, scale, key_heads, conv_pool, rec_pool,
               slots):
        qk = 2 * key_heads * rec_pool.shape[2]
        kept = conv_pool[:, :qk].clone()
        out = kernel(qkv, ba, z, conv_weight, a_log, dt_bias, norm_weight, eps, scale, key_heads, conv_pool,
                     rec_pool, slots)
        conv_pool[:, :qk] = kept
        return out
    return broken


@pytest.mark.parametrize("breaking", [_gate_of_the_next_head, _stuck_key_window], ids=lambda f: f.__name__[1:])
def test_a_failing_one_kernel_decode_step_gives_way_to_the_three_kernels(breaking, monkeypatch, caplog):
    """The one-kernel decode step is checked against float64 like the rest: where it is wrong, start-up serves with
    the three-kernel decode step it extends."""
    pytest.importorskip("triton")
    from shardserve.kernels.triton import deltanet_decode

    monkeypatch.setattr(deltanet_decode, "step_and_norm_in_pool", breaking(deltanet_decode.step_and_norm_in_pool))
    _assert_falls_back_to_triton_decode(_model(TritonFusedDecodeDeltaNetKernels()), "triton fused decode", caplog)
