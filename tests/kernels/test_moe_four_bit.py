"""A single token's 4-bit experts with float16 pair sums (kernels/triton/moe_four_bit.py), the path fused_moe takes
for int4 and e2m1 experts with 16-bit activations: float64's result on the packed definition within float16's
tolerance, gated and non-gated, chunks that run past the columns, a choice outside [0, E) adding nothing, a shared
expert as more choices; reading the codes as the other kind, or a row with another row's group scales (or e2m1's
row scales), is caught. Without CUDA: Triton's interpreter, tiny shapes; on a GPU also Nemotron-3-Nano's and
Qwen3-30B-A3B's expert shapes."""

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
from shardserve.kernels.quant_pack import (fp4_scale_bytes, fp4_scales, pack_scale_zero,  # noqa: E402
                                           reference_weight64, unpack_scale_zero)
from shardserve.kernels.triton.moe_four_bit import (SharedSlots, one_token_four_bit_experts,  # noqa: E402
                                                   shared_slots_fit, takes_float16_pairs)
from shardserve.layers.moe_packed import packed_fused  # noqa: E402
from tests.helpers.kernels import make_routes, relative_error  # noqa: E402
from tests.kernels.test_fused_moe_packed import _fp4, _int4, packed_experts, reference  # noqa: E402

CUDA = torch.cuda.is_available()


def as_other_kind(experts):
    """The experts' codes read with the other 4-bit kind's table under (close to) the same group scales: e2m1
    experts' scales as int4 words with zero points 0; int4 experts' scales as e4m3 bytes under a row scale that puts
    a row's largest at 448, their zero points left out."""
    if experts.kind == "fp4":
        words = [pack_scale_zero(scales, torch.zeros_like(scales))
                 for scales in (fp4_scales(experts.scale13, experts.row13), fp4_scales(experts.scale2, experts.row2))]
        return experts._replace(kind="int4", scale13=words[0], scale2=words[1], row13=None, row2=None)
    parts = []
    for words in (experts.scale13, experts.scale2):
        scales = unpack_scale_zero(words)[0]
        rows = scales.amax(dim=-1) / 448
        parts.append((fp4_scale_bytes((scales / rows[..., None]).to(torch.float8_e4m3fn)), rows.contiguous()))
    (scale13, row13), (scale2, row2) = parts
    return experts._replace(kind="fp4", scale13=scale13, scale2=scale2, row13=row13, row2=row2)


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
    each row with another row's scales (group scales, or e2m1's row scales), is caught."""
    experts = packed_experts(kind, 4, hidden, inter, group, seed=5, activation=activation)
    x, weights, ids = routes_with_a_foreign_choice(4, hidden, dtype)
    assert takes_float16_pairs(experts, dtype) and not takes_float16_pairs(experts, torch.float32)
    want = reference(x, experts, weights, ids)
    tiles = OneTokenTiles(Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))
    got = one_token_four_bit_experts(x, experts, weights, ids, tiles)
    assert got.dtype == dtype and relative_error(got, want) < TOLERANCE[dtype]
    if hidden == 64:  # the default tiles, whole rows a chunk
        assert relative_error(packed_fused(x, experts, weights, ids), want) < TOLERANCE[dtype]
    other = as_other_kind(experts)
    assert relative_error(one_token_four_bit_experts(x, other, weights, ids, tiles), want) > 0.05
    other_rows = [experts._replace(scale2=experts.scale2.roll(1, dims=1).contiguous())]  # each row another's scales
    if kind == "fp4":
        other_rows += [experts._replace(row13=experts.row13.roll(1, dims=1).contiguous()),
                       experts._replace(row2=experts.row2.roll(1, dims=1).contiguous())]
    for wrong in other_rows:
        assert relative_error(one_token_four_bit_experts(x, wrong, weights, ids, tiles), want) > 0.05


def shared_expert(kind: str, features: int, hidden: int, group: int, seed: int = 7):
    """A packed non-gated shared expert (up [S, H/2], its scales, down [H, S/2], its scales), its row scales (up
    [S], down [H]: fp4's; (None, None) for int4) and its float64 weights."""
    g = torch.Generator().manual_seed(seed)
    make = (lambda n, k: _fp4(n, k, group, 1, g)) if kind == "fp4" else (lambda n, k: _int4(n, k, group, 1, False, g))
    parts = []
    for n, k in ((features, hidden), (hidden, features)):
        codes, scale, *rows = make(n, k)
        parts.append((codes[0], scale[0], rows[0][0] if rows else None))
    (up, up_scale, up_rows), (down, down_scale, down_rows) = parts
    return ((up, up_scale, down, down_scale), (up_rows, down_rows),
            (reference_weight64(kind, up, up_scale, group, up_rows),
             reference_weight64(kind, down, down_scale, group, down_rows)))


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("kind, group, hidden, inter, slots", [("fp4", 16, 96, 48, 2), ("int4", 16, 64, 32, 3)])
def test_interpreter_shared_expert_as_slots_adds_it_once(kind, group, hidden, inter, slots):
    """A non-gated shared expert of `slots` times the experts' width as that many more choices of weight 1: the
    routed experts' sum plus relu(h W_up^T)^2 W_down^T, in the same two launches; a shared expert whose width is no
    multiple of the experts' does not fit, nor (fp4) one without its row scales; the shared rows' own row scales are
    read, not the experts'."""
    experts = packed_experts(kind, 4, hidden, inter, group, seed=5, activation="relu2")
    tensors, rows, (up64, down64) = shared_expert(kind, slots * inter, hidden, group)
    assert shared_slots_fit(experts, *tensors, *rows) == slots
    narrow, narrow_rows, _ = shared_expert(kind, inter + 16, hidden, group)
    assert shared_slots_fit(experts, *narrow, *narrow_rows) == 0
    if kind == "fp4":
        assert shared_slots_fit(experts, *tensors) == 0
    x, weights, ids = routes_with_a_foreign_choice(4, hidden, torch.bfloat16)
    x64 = x.double().cpu()
    want = reference(x, experts, weights, ids).cpu() + torch.relu(x64 @ up64.cpu().T).square() @ down64.cpu().T
    tiles = OneTokenTiles(Tile(32, 32, 4, 1), Tile(64, 32, 4, 1))
    got = one_token_four_bit_experts(x, experts, weights, ids, tiles, SharedSlots(*tensors, slots, *rows))
    assert relative_error(got.cpu(), want) < TOLERANCE[torch.bfloat16]
    without = one_token_four_bit_experts(x, experts, weights, ids, tiles)
    assert relative_error(without.cpu(), want) > 0.05
    if kind == "fp4":
        rolled = tuple(r.roll(1).contiguous() for r in rows)
        wrong = one_token_four_bit_experts(x, experts, weights, ids, tiles, SharedSlots(*tensors, slots, *rolled))
        assert relative_error(wrong.cpu(), want) > 0.05


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
    tensors, rows, (up64, down64) = (shared_expert(kind, 2 * inter, hidden, group) if activation == "relu2"
                                     else (None, None, (None, None)))
    if tensors is not None:  # Nemotron-3-Nano's shared expert as two slots
        tensors, rows = (tuple(t if t is None else t.to(x.device) for t in part) for part in (tensors, rows))
        with_shared = one_token_four_bit_experts(x, experts, weights, ids, shared=SharedSlots(*tensors, 2, *rows))
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
