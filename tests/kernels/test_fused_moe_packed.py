"""The fused mixture-of-experts kernel on packed experts (FP8 with a scale per row and group of columns, 4-bit with
scales and zero points, e2m1 codes with an e4m3 scale a group and a float32 scale a row) agrees with float64 on the
packed definition, and would not if it ignored the scales, the zero points or the row scales. Without CUDA the
kernels run in Triton's interpreter on tiny shapes."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.fused_moe_table import MoeConfig, Tile  # noqa: E402
from shardserve.kernels.packed_experts import PackedExperts  # noqa: E402
from shardserve.kernels.quant_pack import fp4_scale_bytes, pack_int4, pack_scale_zero, unpack_scale_zero  # noqa: E402
from shardserve.kernels.self_check import TOLERANCE  # noqa: E402
from shardserve.kernels.triton.fused_moe import fused_moe_packed  # noqa: E402
from tests.helpers.kernels import DEVICE, make_routes, relative_error  # noqa: E402

CUDA = torch.cuda.is_available()
SMALL = MoeConfig(16, Tile(16, 32, 4, 1), Tile(16, 32, 4, 1))


def _fp8(n: int, k: int, group: int, experts: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 codes and scales that differ between groups and rows (a kernel that mixed them up would fail)."""
    w = torch.randn(experts, n, k, generator=g) * 0.1
    blocks = w.reshape(experts, n, k // group, group)
    scale = (blocks.abs().amax(dim=3) / 448.0) * (1 + torch.rand(experts, n, k // group, generator=g))
    codes = (blocks / scale[..., None]).to(torch.float8_e4m3fn).reshape(experts, n, k)
    return codes.to(DEVICE), scale.float().to(DEVICE)


def _int4(n: int, k: int, group: int, experts: int, sym: bool, g: torch.Generator):
    q = torch.randint(0, 16, (experts, n, k), generator=g)
    scale = (torch.rand(experts, n, k // group, generator=g) + 0.5) * 0.02
    zero = torch.full_like(scale, 8.0) if sym else torch.randint(0, 16, scale.shape, generator=g).float()
    packed = torch.stack([pack_int4(q[e]) for e in range(experts)])
    return packed.to(DEVICE), pack_scale_zero(scale, zero).to(DEVICE)


def _fp4(n: int, k: int, group: int, experts: int, g: torch.Generator):
    """Every e2m1 code, e4m3 scale bytes that differ between groups and rows, and float32 row scales [E, N] that
    differ between rows and experts (group scales 0.005 to 0.05 in all)."""
    q = torch.randint(0, 16, (experts, n, k), generator=g)
    scale = ((torch.rand(experts, n, k // group, generator=g) + 0.5) * 256).to(torch.float8_e4m3fn)
    rows = (torch.rand(experts, n, generator=g) + 0.5) * 8e-5
    return (torch.stack([pack_int4(q[e]) for e in range(experts)]).to(DEVICE), fp4_scale_bytes(scale).to(DEVICE),
            rows.to(DEVICE))


def packed_experts(kind: str, experts: int, hidden: int, inter: int, group: int, sym: bool = False,
                   seed: int = 0, activation: str = "swiglu") -> PackedExperts:
    """SwiGLU experts (w13: gate and up rows), or non-gated ones (w13: up rows only) with another activation."""
    g = torch.Generator().manual_seed(seed)
    g13, g2 = min(group, hidden), min(group, inter)
    up_rows = 2 * inter if activation == "swiglu" else inter
    if kind == "fp8":
        (w13, s13), (w2, s2) = _fp8(up_rows, hidden, g13, experts, g), _fp8(hidden, inter, g2, experts, g)
    elif kind == "fp4":
        (w13, s13, r13), (w2, s2, r2) = _fp4(up_rows, hidden, g13, experts, g), _fp4(hidden, inter, g2, experts, g)
        return PackedExperts(kind, w13, s13, g13, w2, s2, g2, activation, r13, r2)
    else:
        (w13, s13), (w2, s2) = _int4(up_rows, hidden, g13, experts, sym, g), _int4(hidden, inter, g2, experts, sym, g)
    return PackedExperts(kind, w13, s13, g13, w2, s2, g2, activation)


def reference(x, experts: PackedExperts, weights, ids) -> torch.Tensor:
    """float64 on the packed definition (PackedExperts.reference), one expert at a time."""
    from shardserve.layers.moe import reference_experts

    return reference_experts(x, None, None, weights, ids, packed=experts)


def check(kind, tokens, group, sym=False, config=None, dtype=torch.float32, hidden=64, inter=32, top_k=2,
          experts_count=4, activation="swiglu"):
    experts = packed_experts(kind, experts_count, hidden, inter, group, sym, activation=activation)
    x, weights, ids = make_routes(tokens, experts_count, top_k, dtype, hidden)
    got = fused_moe_packed(x, experts, weights, ids, config=config)
    want = reference(x, experts, weights, ids)
    error = relative_error(got, want)
    assert error < TOLERANCE[dtype], f"{kind} group {group}: relative error {error:.3g} at {tokens} tokens"
    return experts, x, weights, ids, want


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("kind, group, sym", [("fp8", 32, False), ("int4", 32, True), ("int4", 32, False),
                                              ("int4", 128, False), ("fp4", 16, False)])
def test_interpreter_packed_experts_match_float64(kind, group, sym, tokens):
    """Groups of 32 (two per expert row at H=64, one at I=32) and 128 (one group a row: wider than H and I)."""
    check(kind, tokens, group, sym, config=SMALL)


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("tokens, config", [(1, None), (17, SMALL)])
@pytest.mark.parametrize("kind, group", [("fp4", 16), ("fp8", 32)])
def test_interpreter_packed_non_gated_experts_match_float64(kind, group, tokens, config):
    """NemotronH's non-gated squared-ReLU experts packed (w13 holds only their up rows): one token on the one-token
    path (the table's tiles), 17 on the grouped GEMMs; the reference applies relu(up)^2, so a kernel that read a
    gate, or SwiGLU, would fail."""
    experts, x, weights, ids, want = check(kind, tokens, group, config=config, activation="relu2")
    swiglu_read = experts._replace(activation="silu")
    assert relative_error(fused_moe_packed(x, swiglu_read, weights, ids, config=config), want) > 0.05


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
def test_interpreter_fp8_block_128_with_the_tables_tiles():
    """FP8 in blocks of 128 columns over H = 256 (two scale groups a row), the table's config (block_k narrowed)."""
    check("fp8", 3, 128, hidden=256, inter=128)


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("kind", ["fp8", "int4", "fp4"])
def test_ignoring_scales_or_zeros_fails_the_check(kind):
    """The reference would notice a kernel that dropped the per-group scales (or the zero points, or fp4's row
    scales, or took another expert's): with them made uniform, the kernel's output moves far beyond the
    tolerance."""
    experts, x, weights, ids, want = check(kind, 3, 16 if kind == "fp4" else 32, config=SMALL)
    if kind == "fp8":
        uniform = experts._replace(scale13=experts.scale13.mean().expand_as(experts.scale13).contiguous())
    elif kind == "fp4":
        mean = experts.scale13.view(torch.float8_e4m3fn).float().mean().to(torch.float8_e4m3fn)
        uniform = experts._replace(scale13=fp4_scale_bytes(mean.expand_as(experts.scale13)))
        for rows in (experts.row2.mean().expand_as(experts.row2), experts.row2.roll(1, dims=0)):
            other_rows = experts._replace(row2=rows.contiguous())
            assert relative_error(fused_moe_packed(x, other_rows, weights, ids, config=SMALL), want) > 0.05
    else:
        (scale13, zero13), (scale2, zero2) = unpack_scale_zero(experts.scale13), unpack_scale_zero(experts.scale2)
        uniform = experts._replace(scale13=pack_scale_zero(scale13.mean().expand_as(scale13), zero13))
        no_zero = experts._replace(scale13=pack_scale_zero(scale13, torch.zeros_like(zero13)),
                                   scale2=pack_scale_zero(scale2, torch.zeros_like(zero2)))
        assert relative_error(fused_moe_packed(x, no_zero, weights, ids, config=SMALL), want) > 0.05
    assert relative_error(fused_moe_packed(x, uniform, weights, ids, config=SMALL), want) > 0.05


# -- on a GPU: Qwen3-30B-A3B's experts (E=128, k=8, H=2048, I=768), FP8 in blocks of 128 and 4-bit in groups of 128

QWEN3_30B = (128, 8, 2048, 768)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 64, 129, 512])
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_gpu_qwen3_30b_packed_experts(kind, tokens):
    e, k, h, i = QWEN3_30B
    check(kind, tokens, 128, dtype=torch.bfloat16, hidden=h, inter=i, top_k=k, experts_count=e)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 7, 129])
@pytest.mark.parametrize("kind, group", [("fp4", 16), ("fp8", 64)])
def test_gpu_nemotron_nano_packed_non_gated_experts(kind, group, tokens):
    """Nemotron-3-Nano's squared-ReLU experts (E=128, k=6, H=2688, I=1856) packed as NVFP4, or FP8 in groups of 64."""
    check(kind, tokens, group, dtype=torch.bfloat16, hidden=2688, inter=1856, top_k=6, experts_count=128,
          activation="relu2")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_gpu_packed_experts_replay_in_a_cuda_graph_with_new_routes(kind):
    e, k, h, i = QWEN3_30B
    experts = packed_experts(kind, e, h, i, 128)
    x, weights, ids = make_routes(4, e, k, torch.bfloat16, h)
    fused_moe_packed(x, experts, weights, ids)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_packed(x, experts, weights, ids)
    x2, weights2, ids2 = make_routes(4, e, k, torch.bfloat16, h, seed=7)
    x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
    graph.replay()
    error = relative_error(out, reference(x, experts, weights, ids))
    assert error < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
def test_the_packed_check_runs_every_kernel_config_and_rejects_one_wrong_at_any():
    """Packed experts take the fused kernel only after it matched float64 on their packed values at a token count
    that picks each config of the table (here in the interpreter, with the table's tiles); a kernel wrong only
    at large batches is refused, and so would be a fallback that ignored the scales."""
    from shardserve.kernels.fused_moe_table import CONFIGS, pick_config
    from shardserve.layers.moe_packed import packed_fused, packed_grouped, packed_matches

    experts = packed_experts("fp8", 4, 64, 32, 32)
    seen = []

    def counted(x, experts, weights, ids):
        seen.append(pick_config(x.shape[0], ids.shape[1], experts.num_experts))
        return packed_fused(x, experts, weights, ids)

    def wrong_past_90_tokens(x, experts, weights, ids):
        out = packed_grouped(x, experts, weights, ids)
        return out * 1.01 if x.shape[0] > 90 else out

    assert packed_matches(counted, experts, 2, torch.float32)
    assert set(seen) == {config for _, config in CONFIGS}
    assert packed_matches(packed_grouped, experts, 2, torch.float32)
    assert not packed_matches(wrong_past_90_tokens, experts, 2, torch.float32)
    unscaled = experts._replace(scale2=torch.ones_like(experts.scale2))
    assert not packed_matches(lambda x, e, w, i: packed_grouped(x, unscaled, w, i), experts, 2, torch.float32)


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("kind, group, hidden, inter, down_k", [
    ("fp8", 32, 64, 32, 64), ("fp8", 128, 256, 128, 64), ("int4", 32, 64, 32, 64), ("int4", 16, 96, 48, 64),
    ("fp8", 16, 64, 96, 16), ("fp4", 16, 96, 48, 64)])
def test_interpreter_one_token_packed_experts_match_float64(kind, group, hidden, inter, down_k):
    """A single token takes the matrix-vector products on the packed bytes (one_token_packed_tiles), with tiles
    that span several scale groups, one that runs past the columns (96 = 64 + 32), and w2 rows of six tiles, four
    loaded before the dependent-launch wait and two after; a third choice outside [0, E) (another rank's expert)
    adds nothing."""
    from shardserve.kernels.fused_moe_table import OneTokenTiles

    tiles = OneTokenTiles(Tile(2, 64, 4, 1), Tile(8, down_k, 4, 1))
    experts = packed_experts(kind, 4, hidden, inter, group, seed=3)
    x, weights, ids = make_routes(1, 4, 2, torch.float32, hidden)
    ids, weights = torch.cat([ids, ids.new_tensor([[9]])], 1), torch.cat([weights, weights.new_tensor([[0.5]])], 1)
    got = fused_moe_packed(x, experts, weights, ids, config=tiles)
    error = relative_error(got, reference(x, experts, weights, ids))
    assert error < TOLERANCE[torch.float32], f"{kind} group {group}: relative error {error:.3g}"
    if kind == "fp8":
        uniform = experts._replace(scale2=experts.scale2.mean().expand_as(experts.scale2).contiguous())
        assert relative_error(fused_moe_packed(x, uniform, weights, ids, config=tiles), got) > 0.05
    if kind == "fp4":  # each expert's row scales, not another's
        other_experts = experts._replace(row13=experts.row13.roll(1, dims=0).contiguous())
        assert relative_error(fused_moe_packed(x, other_experts, weights, ids, config=tiles), got) > 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (9, 0), reason="Hopper's bulk prefetch")
@pytest.mark.parametrize("hidden, inter, experts_count, top_k, activation", [
    (2048, 512, 64, 10, "swiglu"), (2048, 768, 32, 6, "relu2")])
def test_gpu_asking_l2_for_the_w2_rows_changes_no_bit(set_env, hidden, inter, experts_count, top_k, activation):
    """A single token's FP8 w13 programs ask L2 for their experts' w2 rows (kernels/triton/l2_prefetch.py; not with
    SHARDSERVE_MOE_PREFETCH_DOWN=off): they read ahead and write nothing, so the token's experts, another rank's
    choice among them (whose programs ask for nothing), give the same bits either way."""
    experts = packed_experts("fp8", experts_count, hidden, inter, 128, seed=2, activation=activation)
    x, weights, ids = make_routes(1, experts_count, top_k, torch.bfloat16, hidden)
    weights, ids = torch.cat([weights, weights.new_tensor([[0.5]])], 1), torch.cat([ids, ids.new_tensor([[99]])], 1)
    outs = []
    for prefetch in ("off", "on"):
        set_env(SHARDSERVE_MOE_PREFETCH_DOWN=prefetch)
        outs.append(fused_moe_packed(x, experts, weights, ids))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    assert relative_error(outs[1], reference(x, experts, weights, ids)) < TOLERANCE[torch.bfloat16]


def test_the_w2_requests_cover_each_experts_rows_in_aligned_runs():
    """l2_prefetch.rows_prefetch: the launch's programs split an expert's rows into runs that cover every row once,
    each run whole rows of a 16-byte multiple; rows that are not such runs (a column slice, 100-byte rows) get no
    requests."""
    from shardserve.kernels.triton.l2_prefetch import rows_prefetch

    for w, programs in ((torch.zeros(3, 2048, 512, dtype=torch.uint8), 256),   # Qwen3-Next's FP8 w2
                        (torch.zeros(2, 2688, 232, dtype=torch.int32), 58)):    # 4-bit words, 928 bytes a row
        args = rows_prefetch(w, programs)
        rows, run = args["W2_ROWS"], args["PREFETCH_ROWS"]
        covered = [r for p in range(programs) for r in range(p * run, min(p * run + run, rows))]
        assert covered == list(range(w.shape[1]))
        assert args["W2_ROW_BYTES"] == w.shape[2] * w.element_size() and args["W2_ROW_BYTES"] % 16 == 0
        assert (args["stride_w2e"], args["stride_w2n"]) == w.stride()[:2]
    assert rows_prefetch(torch.zeros(2, 64, 512, dtype=torch.uint8)[:, :, :256], 8) == {}
    assert rows_prefetch(torch.zeros(2, 64, 100, dtype=torch.uint8), 8) == {}
