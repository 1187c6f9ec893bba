"""A single token's 4-bit experts with float16 pair sums (kernels/triton/moe_four_bit.py), the path fused_moe takes
for int4 and e2m1 experts with 16-bit activations: float64's result on the packed definition within float16's
tolerance, gated and non-gated, chunks that run past the columns, a choice outside [0, E) adding nothing; reading
the codes as the other kind, or leaving the group scales out, is caught. Without CUDA: Triton's interpreter, tiny
shapes; on a GPU also Nemotron-3-Nano's and Qwen3-30B-A3B's expert shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.fused_moe_table import OneTokenTiles, Tile  # noqa: E402
from shardserve.kernels.self_check import TOLERANCE  # noqa: E402
from shardserve.kernels.triton.fused_moe import fused_moe_packed  # noqa: E402
from shardserve.kernels.triton.moe_four_bit import one_token_four_bit_experts, takes_float16_pairs  # noqa: E402
from tests.helpers.kernels import make_routes, relative_error  # noqa: E402
from tests.kernels.test_fused_moe_packed import packed_experts, reference  # noqa: E402

CUDA = torch.cuda.is_available()


def routes_with_a_foreign_choice(experts, hidden: int, dtype, top_k: int = 2):
    """One token's top-k choices plus one outside [0, E) (another rank's expert, weight 0.5)."""
    x, weights, ids = make_routes(1, experts, top_k, dtype, hidden)
    return x, torch.cat([weights, weights.new_tensor([[0.5]])], 1), torch.cat([ids, ids.new_tensor([[experts + 5]])], 1)


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("kind, group, hidden, inter, activation", [
    ("fp4", 16, 96, 48, "relu2"), ("fp4", 32, 64, 32, "swiglu"), ("int4", 16, 96, 48, "swiglu"),
    ("int4", 32, 64, 96, "relu2")])
def test_interpreter_float16_pair_sums_match_float64(kind, group, hidden, inter, activation):
    """Chunks of 32 columns over 96 and 48 (the last one partly past the columns), rows past the tile's end."""
    experts = packed_experts(kind, 4, hidden, inter, group, seed=5, activation=activation)
    for dtype in (torch.float16, torch.bfloat16):
        x, weights, ids = routes_with_a_foreign_choice(4, hidden, dtype)
        assert takes_float16_pairs(experts, dtype) and not takes_float16_pairs(experts, torch.float32)
        want = reference(x, experts, weights, ids)
        tiles = OneTokenTiles(Tile(16, 32, 4, 1), Tile(8, 32, 4, 1))
        got = one_token_four_bit_experts(x, experts, weights, ids, tiles)
        assert got.dtype == dtype and relative_error(got, want) < TOLERANCE[dtype], (kind, dtype)
        # fused_moe's one-token path takes it with its own tiles
        assert relative_error(fused_moe_packed(x, experts, weights, ids), want) < TOLERANCE[dtype]
    other = experts._replace(kind="int4" if kind == "fp4" else "fp4")
    assert relative_error(one_token_four_bit_experts(x, other, weights, ids, tiles), want) > 0.05
    other_rows = experts._replace(scale2=experts.scale2.roll(1, dims=1).contiguous())  # each row another's scales
    assert relative_error(one_token_four_bit_experts(x, other_rows, weights, ids, tiles), want) > 0.05


def test_float16_pair_sums_are_off_for_float32_and_when_asked(set_env):
    experts = packed_experts("fp4", 2, 64, 32, 16)
    assert takes_float16_pairs(experts, torch.bfloat16)
    assert not takes_float16_pairs(experts, torch.float32)
    assert not takes_float16_pairs(packed_experts("fp8", 2, 64, 32, 16), torch.bfloat16)
    set_env(SHARDSERVE_MOE_FOUR_BIT_SUMS="float32")
    assert not takes_float16_pairs(experts, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("kind, group, hidden, inter, experts_count, top_k, activation", [
    ("fp4", 16, 2688, 1856, 128, 6, "relu2"), ("int4", 128, 2048, 768, 128, 8, "swiglu"),
    ("fp4", 32, 2048, 768, 128, 8, "swiglu")])
def test_gpu_float16_pair_sums_match_float64(kind, group, hidden, inter, experts_count, top_k, activation):
    experts = packed_experts(kind, experts_count, hidden, inter, group, seed=1, activation=activation)
    x, weights, ids = routes_with_a_foreign_choice(experts_count, hidden, torch.bfloat16, top_k)
    want = reference(x, experts, weights, ids)
    assert relative_error(fused_moe_packed(x, experts, weights, ids), want) < TOLERANCE[torch.bfloat16]
