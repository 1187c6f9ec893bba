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

from shardserve import envs  # noqa: E402
from shardserve.kernels.fused_moe_table import OneTokenTiles, Tile  # noqa: E402
from shardserve.kernels.self_check import TOLERANCE  # noqa: E402
from shardserve.kernels.quant_pack import reference_weight64  # noqa: E402
from shardserve.kernels.triton.moe_four_bit import (SharedSlots, one_token_four_bit_experts,  # noqa: E402
                                                   shared_slots_fit, takes_float16_pairs)
from shardserve.layers.moe_packed import packed_fused  # noqa: E402
from tests.helpers.kernels import make_routes, relative_error  # noqa: E402
from tests.kernels.test_fused_moe_packed import _fp4, _int4, packed_experts, reference  # noqa: E402

CUDA = torch.cuda.is_available()


def routes_with_a_foreign_choice(experts, hidden: int, dtype, top_k: int = 2):
    """One token's top-k choices plus one outside [0, E) (another rank's expert, weight 0.5)."""
    x, weights, ids = make_routes(1, experts, top_k, dtype, hidden)
    return x, torch.cat([weights, weights.new_tensor([[0.5]])], 1), torch.cat([ids, ids.new_tensor([[experts + 5]])], 1)


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("kind, group, hidden, inter, activation, dtype", [
    ("fp4", 16, 96, 48, "relu2", torch.bfloat16), ("fp4", 32, 64, 32, "swiglu", torch.float16),
    ("int4", 16, 96, 48, "swiglu", torch.bfloat16), ("int4", 32, 64, 96, "relu2", torch.float16)])
def test_interpreter_float16_pair_sums_match_float64(kind, group, hidden, inter, activation, dtype):
    """Chunks of 32 columns over 96 and 48 (the last one partly past the columns), tiles past the last row; the
    packed experts' fused path takes these kernels with their own tiles; reading the codes as the other kind, or
    each row with another row's scales, is caught."""
    experts = packed_experts(kind, 4, hidden, inter, group, seed=5, activation=activation)
    x, weights, ids = routes_with_a_foreign_choice(4, hidden, dtype)
    assert takes_float16_pairs(experts, dtype) and not takes_float16_pairs(experts, torch.float32)
    want = reference(x, experts, weights, ids)
    tiles = OneTokenTiles(Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))
    got = one_token_four_bit_experts(x, experts, weights, ids, tiles)
    assert got.dtype == dtype and relative_error(got, want) < TOLERANCE[dtype]
    if hidden == 64:  # the default tiles, whole rows a chunk
        assert relative_error(packed_fused(x, experts, weights, ids), want) < TOLERANCE[dtype]
    other = experts._replace(kind="int4" if kind == "fp4" else "fp4")
    assert relative_error(one_token_four_bit_experts(x, other, weights, ids, tiles), want) > 0.05
    other_rows = experts._replace(scale2=experts.scale2.roll(1, dims=1).contiguous())  # each row another's scales
    assert relative_error(one_token_four_bit_experts(x, other_rows, weights, ids, tiles), want) > 0.05


def shared_expert(kind: str, features: int, hidden: int, group: int, seed: int = 7):
    """A packed non-gated shared expert (up [S, H/2], its scales, down [H, S/2], its scales) and its float64
    weights."""
    g = torch.Generator().manual_seed(seed)
    make = (lambda n, k: _fp4(n, k, group, 1, g)) if kind == "fp4" else (lambda n, k: _int4(n, k, group, 1, False, g))
    (up, up_scale), (down, down_scale) = make(features, hidden), make(hidden, features)
    up, up_scale, down, down_scale = up[0], up_scale[0], down[0], down_scale[0]
    return (up, up_scale, down, down_scale), (reference_weight64(kind, up, up_scale, group),
                                              reference_weight64(kind, down, down_scale, group))


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("kind, group, hidden, inter, slots", [("fp4", 16, 96, 48, 2), ("int4", 16, 64, 32, 3)])
def test_interpreter_shared_expert_as_slots_adds_it_once(kind, group, hidden, inter, slots):
    """A non-gated shared expert of `slots` times the experts' width as that many more choices of weight 1: the
    routed experts' sum plus relu(h W_up^T)^2 W_down^T, in the same two launches; a shared expert whose width is no
    multiple of the experts' does not fit."""
    experts = packed_experts(kind, 4, hidden, inter, group, seed=5, activation="relu2")
    tensors, (up64, down64) = shared_expert(kind, slots * inter, hidden, group)
    assert shared_slots_fit(experts, *tensors) == slots
    assert shared_slots_fit(experts, *shared_expert(kind, inter + 16, hidden, group)[0]) == 0
    x, weights, ids = routes_with_a_foreign_choice(4, hidden, torch.bfloat16)
    x64 = x.double().cpu()
    want = reference(x, experts, weights, ids).cpu() + torch.relu(x64 @ up64.cpu().T).square() @ down64.cpu().T
    tiles = OneTokenTiles(Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))
    got = one_token_four_bit_experts(x, experts, weights, ids, tiles, SharedSlots(*tensors, slots))
    assert relative_error(got.cpu(), want) < TOLERANCE[torch.bfloat16]
    without = one_token_four_bit_experts(x, experts, weights, ids, tiles)
    assert relative_error(without.cpu(), want) > 0.05


def test_float16_pair_sums_are_off_for_float32_and_when_asked(set_env):
    from shardserve.layers.moe_packed import four_bit_one_token

    experts = packed_experts("fp4", 2, 64, 32, 16)
    assert takes_float16_pairs(experts, torch.bfloat16)
    one, two = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    assert four_bit_one_token(one, experts) and not four_bit_one_token(two, experts)
    with envs.override(SHARDSERVE_MOE_ONE_TOKEN="gemm"):  # a single token kept on the grouped GEMMs
        assert not four_bit_one_token(one, experts)
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
    assert relative_error(packed_fused(x, experts, weights, ids), want) < TOLERANCE[torch.bfloat16]
    tensors, (up64, down64) = (shared_expert(kind, 2 * inter, hidden, group) if activation == "relu2"
                                  else (None, (None, None)))
    if tensors is not None:  # Nemotron-3-Nano's shared expert as two slots
        tensors = tuple(t.to(x.device) for t in tensors)
        with_shared = one_token_four_bit_experts(x, experts, weights, ids, shared=SharedSlots(*tensors, 2))
        x64 = x.double().cpu()
        want = want.cpu() + torch.relu(x64 @ up64.cpu().T).square() @ down64.cpu().T
        assert relative_error(with_shared.cpu(), want) < TOLERANCE[torch.bfloat16]


def test_tiles_come_from_the_variable_and_a_bad_one_is_named(set_env):
    from shardserve.kernels.triton.moe_four_bit import FOUR_BIT_PAIR_TILES, four_bit_pair_tiles

    assert four_bit_pair_tiles() == FOUR_BIT_PAIR_TILES
    set_env(SHARDSERVE_MOE_FOUR_BIT_TILES="8,256,4,1/64,1024,8,1")
    assert four_bit_pair_tiles() == OneTokenTiles(Tile(8, 256, 4, 1), Tile(64, 1024, 8, 1))
    set_env(SHARDSERVE_MOE_FOUR_BIT_TILES="8,256,4")
    with pytest.raises(ValueError, match="SHARDSERVE_MOE_FOUR_BIT_TILES='8,256,4'"):
        four_bit_pair_tiles()
