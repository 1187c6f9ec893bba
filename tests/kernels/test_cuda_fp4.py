"""The CUDA C fp4 kernels (kernels/cuda/fp4_products.cu, compiled by NVRTC): the GEMV and one token's non-gated
experts give float64's result on the packed definition within the 16-bit tolerance, at tiny shapes and
Nemotron-3-Nano's, in every launch shape start-up may time, with choices outside [0, E) left out and the shared
expert's slots added once; a row read with another row's scales is caught. Without a Hopper GPU: where they cannot
run they are neither timed nor taken, and shapes they cannot take are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from shardserve.kernels.cuda import runtime
from shardserve.kernels.cuda.fp4_products import GEMV_CONFIGS, experts_fit, fp4_experts, fp4_gemv, gemv_fits
from shardserve.kernels.quant_pack import reference_weight64
from shardserve.kernels.self_check import TOLERANCE
from shardserve.layers.quantization.fp4 import Fp4Format, is_cuda_form
from tests.helpers.kernels import relative_error

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
gpu = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")


def fp4_rows(n: int, k: int, seed: int = 0):
    """(codes [N, K / 2], e4m3 scale bytes [N, K / 16], float32 row scales [N]) with every e2m1 code, on the GPU
    where there is one."""
    from tests.kernels.test_fused_moe_packed import _fp4

    codes, scales, rows = _fp4(n, k, 16, 1, torch.Generator().manual_seed(seed))
    return codes[0].contiguous(), scales[0].contiguous(), rows[0].contiguous()


def test_shapes_it_cannot_take_are_refused_with_the_reason():
    assert "multiple of 32" in gemv_fits(64, 100)
    assert "groups of 16" in gemv_fits(64, 128, group=32)
    assert "at most" in gemv_fits(64, 32768)
    assert gemv_fits(10304, 2688) is None
    from tests.kernels.test_fused_moe_packed import packed_experts

    gated = packed_experts("fp4", 4, 64, 32, 16, activation="swiglu")
    assert "non-gated fp4" in experts_fit(gated, torch.bfloat16, 2)
    relu2 = packed_experts("fp4", 4, 64, 32, 16, activation="relu2")
    assert experts_fit(relu2, torch.bfloat16, 2) is None
    assert "16-bit" in experts_fit(relu2, torch.float32, 2)
    assert "groups of 16" in experts_fit(packed_experts("fp4", 4, 64, 32, 32, activation="relu2"), torch.bfloat16, 2)
    assert "int4" in experts_fit(packed_experts("int4", 4, 64, 32, 16, activation="relu2"), torch.bfloat16, 2)


@pytest.mark.skipif(HOPPER, reason="what a machine without a Hopper GPU does")
def test_without_a_hopper_gpu_they_are_neither_timed_nor_taken():
    assert not runtime.available(torch.device("cpu"))

    class Packed:  # what Fp4Format.split_forms reads of a packed layer
        n, k, group, device = 10304, 2688, 16, torch.device("cpu")

    forms = Fp4Format().split_forms(Packed())
    assert forms and not any(is_cuda_form(f) for f in forms)


def test_the_switch_turns_them_off(set_env):
    set_env(SHARDSERVE_CUDA_KERNELS="off")
    assert not runtime.available(torch.device("cuda", 0))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(37, 64), (300, 2688), (2688, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp4_gemv_matches_float64(n, k, dtype):
    codes, scales, rows = fp4_rows(n, k)
    x = torch.randn(1, k, device="cuda").to(dtype) * 4
    want = x.double() @ reference_weight64("fp4", codes, scales, 16, rows).T
    for config in GEMV_CONFIGS:
        got = fp4_gemv(x, codes, scales, rows, *config)
        assert got.dtype == dtype and got.shape == (1, n)
        assert relative_error(got, want) < TOLERANCE[dtype], config
    wrong = fp4_gemv(x, codes, scales.roll(1, dims=0).contiguous(), rows)  # each row another row's group scales
    assert relative_error(wrong, want) > 0.05
    assert relative_error(fp4_gemv(x, codes, scales, rows.roll(1).contiguous()), want) > 0.05


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("hidden, inter, experts_count, top_k", [(128, 64, 4, 2), (2688, 1856, 16, 6)])
@pytest.mark.parametrize("ids_dtype, weights_dtype", [(torch.int64, torch.float32), (torch.int32, torch.bfloat16)])
def test_gpu_fp4_experts_match_float64(hidden, inter, experts_count, top_k, ids_dtype, weights_dtype):
    """Routed choices plus one outside [0, E), then the shared expert as two more slots, against float64; with the
    experts' scales of another row the result is caught."""
    from tests.kernels.test_fused_moe_packed import packed_experts, reference
    from tests.kernels.test_moe_four_bit import routes_with_a_foreign_choice, shared_expert
    from shardserve.kernels.triton.moe_four_bit import SharedSlots

    experts = packed_experts("fp4", experts_count, hidden, inter, 16, seed=5, activation="relu2")
    x, weights, ids = routes_with_a_foreign_choice(experts_count, hidden, torch.bfloat16, top_k)
    ids, weights = ids.to(ids_dtype).contiguous(), weights.to(weights_dtype).contiguous()
    want = reference(x, experts, weights.float(), ids.long())
    got = fp4_experts(x, experts, weights, ids)
    assert relative_error(got, want) < TOLERANCE[torch.bfloat16]
    tensors, rows, (up64, down64) = shared_expert("fp4", 2 * inter, hidden, 16)
    with_shared = want + torch.relu(x.double() @ up64.T).square() @ down64.T
    got = fp4_experts(x, experts, weights, ids, SharedSlots(*tensors, 2, *rows))
    assert relative_error(got, with_shared) < TOLERANCE[torch.bfloat16]
    # x's pairs built before the dependent-launch wait (x written launches earlier): the same sums
    assert torch.equal(fp4_experts(x, experts, weights, ids, SharedSlots(*tensors, 2, *rows), x_early=True), got)
    wrong = experts._replace(scale2=experts.scale2.roll(1, dims=1).contiguous())
    assert relative_error(fp4_experts(x, wrong, weights, ids), want) > 0.05


@gpu
@pytest.mark.gpu
def test_gpu_the_experts_path_takes_them_unless_switched_off(set_env):
    """The packed experts' one-token path runs these kernels; off, the Triton ones: both float64's result."""
    from tests.kernels.test_fused_moe_packed import packed_experts, reference
    from tests.kernels.test_moe_four_bit import routes_with_a_foreign_choice
    from shardserve.layers.moe_packed import one_token_four_bit

    experts = packed_experts("fp4", 4, 128, 64, 16, seed=5, activation="relu2")
    x, weights, ids = routes_with_a_foreign_choice(4, 128, torch.bfloat16)
    want = reference(x, experts, weights, ids)
    cuda = one_token_four_bit(x, experts, weights, ids)
    assert torch.equal(cuda, fp4_experts(x, experts, weights, ids))
    set_env(SHARDSERVE_CUDA_KERNELS="off")
    triton_sums = one_token_four_bit(x, experts, weights, ids)
    for got in (cuda, triton_sums):
        assert relative_error(got, want) < TOLERANCE[torch.bfloat16]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("with_residual", [True, False])
def test_gpu_fp4_gemv_after_the_norm_that_leaves_its_pairs(with_residual):
    """(W RMSNorm(x + residual), x + residual), the norm made once as the GEMV's float16 pairs: float64's product of
    the norm kernel's output in every GEMV configuration, and the sum as the norm kernel stores it."""
    from shardserve.layers.norm import RMSNorm

    from shardserve.kernels.cuda.fp4_products import fp4_gemv_rmsnorm

    n, k = 300, 2688
    codes, scales, rows = fp4_rows(n, k)
    norm = RMSNorm(k, 1e-5, torch.bfloat16).cuda()
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16) * 3
    residual = torch.randn(1, k, device="cuda").to(torch.bfloat16) if with_residual else None
    if with_residual:  # the norm kernel updates its inputs in place
        normed, summed_want = norm(x.clone(), residual.clone())
    else:
        normed, summed_want = norm(x.clone()), x
    want = normed.double() @ reference_weight64("fp4", codes, scales, 16, rows).T
    for config in GEMV_CONFIGS:
        got, summed = fp4_gemv_rmsnorm(x, residual, norm.weight, norm.eps, codes, scales, rows, *config)
        assert relative_error(got, want) < TOLERANCE[torch.bfloat16], config
        assert torch.equal(summed, summed_want)


def test_a_kernel_that_cannot_compile_turns_them_off_with_the_reason(monkeypatch, caplog):
    """Without NVRTC compiling raises CompileError; after one, none of these kernels is offered (one WARNING), so
    the GEMV's start-up choice and the experts' path (moe_packed.one_token_four_bit) keep to the Triton kernels."""
    monkeypatch.setattr(runtime, "nvrtc", lambda: None)
    with pytest.raises(runtime.CompileError, match="NVRTC is not available"):
        runtime.compile_cubin("", "fp4_products.cu", "sm_90a", "fp4_gemv<64, 1, 4, 1, 0, 0, 0>")
    monkeypatch.setattr(runtime, "_failed", None)
    with caplog.at_level("WARNING", logger=runtime.__name__):
        runtime.disable(runtime.CompileError("no NVRTC"))
        runtime.disable(runtime.CompileError("again"))
    assert [r.getMessage() for r in caplog.records if "CUDA C kernels off" in r.getMessage()] == [
        "CUDA C kernels off for this process (the Triton kernels serve instead): no NVRTC"]
    assert not runtime.available(torch.device("cuda", 0))
