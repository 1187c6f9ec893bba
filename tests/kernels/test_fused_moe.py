"""The fused mixture-of-experts kernel agrees with a float64 reference, and CUDA graphs replay it on new routes.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (tiny shapes; float32 and float16, since the
interpreter multiplies no bfloat16 matrices). On CUDA the shapes include Qwen3-30B-A3B's experts at TP 1.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.self_check import TOLERANCE  # noqa: E402
from shardserve.kernels.fused_moe_table import MoeConfig, OneTokenTiles, Tile, pick_config  # noqa: E402
from shardserve.kernels.triton.fused_moe import (align_pairs, fused_moe, fused_moe_from_logits,  # noqa: E402
                                                 route_and_align)
from shardserve.kernels.triton.moe_router import route_top_k  # noqa: E402
from shardserve.layers.moe import route_reference  # noqa: E402
from tests.helpers.kernels import make_routes, relative_error  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32, torch.float16]
# Real shape: Qwen3-30B-A3B's experts on one rank (E, k, H, I).
QWEN3_30B = (128, 8, 2048, 768)
# Small tiles for the interpreter: several reduction steps over H, and a tile wider than I's remainder.
SMALL = MoeConfig(16, Tile(16, 16, 4, 1), Tile(16, 16, 4, 1))


def reference_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """float64, one expert at a time over the pairs that chose it; choices outside [0, E) add nothing."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token, choice = (ids == expert).nonzero(as_tuple=True)
        if token.numel():
            gate, up = (x[token] @ w13[expert].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[expert].T
            out.index_add_(0, token, y * weights[token, choice, None])
    return out


def make_experts(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=DEVICE) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * inter ** -0.5).to(dtype)
    return w13, w2


def check_against_reference(tokens, num_experts, top_k, hidden, inter, dtype, config=None, same_route=False,
                            ids_dtype=torch.int64):
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x, weights, ids = make_routes(tokens, num_experts, top_k, dtype, hidden, ids_dtype=ids_dtype)
    if same_route:
        weights, ids = weights[:1].expand_as(weights).contiguous(), ids[:1].expand_as(ids).contiguous()
    got = fused_moe(x, w13, w2, weights, ids, config=config)
    assert got.shape == x.shape and got.dtype == dtype
    error = relative_error(got, reference_moe(x, w13, w2, weights, ids))
    assert error < TOLERANCE[dtype], f"relative error {error:.3g} at T={tokens} E={num_experts} k={top_k}"
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Alignment


@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 4, 2, 16), (8, 4, 2, 16), (7, 128, 8, 16),
                                                              (130, 8, 2, 64), (64, 128, 8, 32)])
def test_alignment_groups_every_pair_once_by_expert(tokens, num_experts, top_k, block_m):
    """Each block holds pairs of its own expert, in pair order, padded with T*k; every pair appears once; experts
    without pairs get no block; blocks past the groups are marked -1."""
    _, _, ids = make_routes(tokens, num_experts, top_k, torch.float32, 8)
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    sorted_pairs, block_expert, flat = sorted_pairs.cpu(), block_expert.cpu(), ids.flatten().cpu()
    used = block_expert[block_expert >= 0]
    assert (block_expert[len(used):] == -1).all()  # the groups come first
    assert torch.equal(used, used.sort().values)
    assert set(used.tolist()) == set(flat.tolist())
    pairs = sorted_pairs[:len(used) * block_m].view(-1, block_m)
    real = pairs < flat.numel()
    assert torch.equal(pairs[~real], torch.full_like(pairs[~real], flat.numel()))
    assert torch.equal(flat[pairs[real].long()], used[:, None].expand_as(pairs)[real])
    assert torch.equal(pairs[real].sort().values, torch.arange(flat.numel(), dtype=torch.int32))
    groups = [pairs[used == e][real[used == e]] for e in used.unique()]
    assert all(torch.equal(p, p.sort().values) for p in groups)
    assert all(len(p) > (used == e).sum().item() * block_m - block_m for p, e in zip(groups, used.unique()))


@pytest.mark.parametrize("tokens,num_experts,top_k,block_m", [(1, 4, 2, 16), (130, 8, 2, 64), (64, 129, 8, 32),
                                                              (300, 33, 4, 16)])
def test_alignment_by_sort_equals_the_one_program_alignment(tokens, num_experts, top_k, block_m):
    """Many pairs are aligned through torch's device sort (align_pairs_by_sort) instead of one program comparing
    every pair with every expert: the same groups, slots and block owners, choices of other ranks' experts (ids
    past E or below 0) left out of every group alike."""
    from shardserve.kernels.triton.fused_moe import align_pairs_by_sort

    _, _, ids = make_routes(tokens, num_experts + 3, top_k, torch.float32, 8)
    ids = ids - 1  # experts -1 and E, E + 1 are another rank's
    want_pairs, want_owner = align_pairs(ids, num_experts, block_m)
    got_pairs, got_owner = align_pairs_by_sort(ids.reshape(-1), num_experts, block_m)
    assert torch.equal(got_owner, want_owner)
    used = int((want_owner >= 0).sum()) * block_m
    assert torch.equal(got_pairs[:used], want_pairs[:used])
    assert (got_pairs[used:] == ids.numel()).all()


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
def test_experts_on_the_sorted_alignment_match_the_reference(monkeypatch):
    """The fused experts on align_pairs_by_sort's groups (every alignment taken that way here) equal the reference."""
    from shardserve.kernels.triton import fused_moe as module

    monkeypatch.setattr(module, "ALIGN_IN_ONE_PROGRAM_MAX", 0)
    for tokens in (3, 17):
        check_against_reference(tokens, 4, 2, 32, 16, torch.float32, config=SMALL)


# ---------------------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs the larger set below")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (2, 2), (5, 1), (8, 2), (8, 4)])
def test_interpreter_matches_reference(dtype, tokens, top_k):
    ids = check_against_reference(tokens, 4, top_k, 32, 16, dtype, config=SMALL)
    check_against_reference(tokens, 4, top_k, 32, 16, dtype)  # the table's config: tiles wider than H and I
    if tokens == 1:
        assert len(ids.unique()) < 4  # some experts receive no token


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
def test_interpreter_uneven_sizes_and_one_shared_route():
    """H and I not multiples of the tiles (masked, not dropped); every token on the same experts; int32 ids."""
    check_against_reference(6, 4, 2, 48, 24, torch.float32, config=MoeConfig(16, Tile(16, 32, 4, 1),
                                                                            Tile(16, 32, 4, 1)))
    check_against_reference(8, 4, 2, 32, 16, torch.float16, config=SMALL, same_route=True, ids_dtype=torch.int32)


def check_from_logits(tokens, num_experts, top_k, hidden, inter, dtype, renormalize=True, held=None, config=None):
    """fused_moe_from_logits against the float64 reference on the torch router's choice; `held` (e0, e1): this
    rank holds only those experts (expert parallelism), the others' choices add nothing."""
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g, device=DEVICE)  # float32: no ties
    e0, e1 = held or (0, num_experts)
    got = fused_moe_from_logits(x, logits, w13[e0:e1], w2[e0:e1], top_k, renormalize, e0, config=config)
    weights, ids = route_reference(logits, top_k, renormalize)
    want = reference_moe(x, w13[e0:e1], w2[e0:e1], weights, ids - e0)
    if not want.any():  # no choice of this rank's experts
        assert not got.any()
        return got
    error = relative_error(got, want)
    assert error < TOLERANCE[dtype], f"relative error {error:.3g} at T={tokens} held={held}"
    return got


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes")
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("renormalize", [True, False])
def test_interpreter_experts_from_logits_match_reference(tokens, renormalize):
    """One token takes the one-launch choice and alignment, more the router kernel then fused_moe; the shares of
    two ranks' experts (expert parallelism) add up to the whole."""
    dtype = torch.float32
    whole = check_from_logits(tokens, 8, 2, 32, 16, dtype, renormalize)
    first = check_from_logits(tokens, 8, 2, 32, 16, dtype, renormalize, held=(0, 4))
    second = check_from_logits(tokens, 8, 2, 32, 16, dtype, renormalize, held=(4, 8))
    assert torch.equal(first + second, whole)  # two choices a token: one float32 addition either way


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 8, 2), (2, 8, 2), (1, 128, 8), (3, 60, 4)])
def test_route_and_align_equal_the_two_kernels(tokens, num_experts, top_k):
    """The one-program choice and alignment store what route_top_k and align_pairs store."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    logits = torch.randn(tokens, num_experts, generator=g, device=DEVICE)
    weights, ids, sorted_pairs, block_expert = route_and_align(logits, top_k, True, num_experts, 16)
    want_weights, want_ids = route_top_k(logits, top_k, True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    want_sorted, want_blocks = align_pairs(want_ids, num_experts, 16)
    assert expert_groups(sorted_pairs, block_expert, 16, tokens * top_k) == \
        expert_groups(want_sorted, want_blocks, 16, tokens * top_k)
    if tokens > 1:  # a single token's blocks follow its choices, not the experts' order
        assert torch.equal(block_expert, want_blocks)


@pytest.mark.parametrize("id_base,num_experts", [(0, 128), (16, 16), (100, 40)])
def test_one_token_alignment_of_this_ranks_experts(id_base, num_experts):
    """A single token's alignment (expert parallelism: this rank holds experts [id_base, id_base + E)) groups the
    same pairs under the same experts as align_pairs, and leaves other ranks' choices out."""
    top_k, all_experts = 8, 160
    g = torch.Generator(device=DEVICE).manual_seed(11)
    logits = torch.randn(1, all_experts, generator=g, device=DEVICE)
    _, ids, sorted_pairs, block_expert = route_and_align(logits, top_k, True, num_experts, 16, id_base)
    local = ids - id_base
    local[(local < 0) | (local >= num_experts)] = -1
    want_sorted, want_blocks = align_pairs(local, num_experts, 16)
    groups = expert_groups(sorted_pairs, block_expert, 16, top_k)
    assert groups == expert_groups(want_sorted, want_blocks, 16, top_k)
    assert sorted(groups) == sorted(e for e in local[0].tolist() if e >= 0)


def expert_groups(sorted_pairs, block_expert, block_m, sentinel) -> dict[int, list[int]]:
    """expert -> its pairs in block order, after checking that every slot of a used block holds a pair or the
    sentinel."""
    blocks = block_expert.tolist()
    groups: dict[int, list[int]] = {}
    for b in (b for b, e in enumerate(blocks) if e >= 0):
        slots = sorted_pairs[b * block_m:(b + 1) * block_m].tolist()
        assert all(0 <= p <= sentinel for p in slots)
        groups.setdefault(blocks[b], []).extend(p for p in slots if p < sentinel)
    return groups


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [2, 8])
@pytest.mark.parametrize("num_experts", [8, 128])
@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 64, 130, 512])
def test_gpu_matches_reference(tokens, num_experts, top_k, dtype):
    ids = check_against_reference(tokens, num_experts, top_k, 256, 128, dtype)
    if num_experts == 128 and tokens <= 7:
        assert len(ids.unique()) < num_experts  # some experts receive no token


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [7, 130])
def test_gpu_every_token_on_the_same_experts(tokens, dtype):
    """One expert's group spans several blocks (130 * 1 rows of each chosen expert)."""
    check_against_reference(tokens, 128, 8, 256, 128, dtype, same_route=True, ids_dtype=torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_qwen3_30b_shape(tokens):
    num_experts, top_k, hidden, inter = QWEN3_30B
    check_against_reference(tokens, num_experts, top_k, hidden, inter, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="GPU shapes")
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_gpu_qwen3_30b_shape_from_logits(tokens):
    num_experts, top_k, hidden, inter = QWEN3_30B
    check_from_logits(tokens, num_experts, top_k, hidden, inter, torch.bfloat16)
    check_from_logits(tokens, num_experts, top_k, hidden, inter, torch.bfloat16, held=(64, 128))


def test_choices_of_other_ranks_add_nothing_and_results_repeat_exactly():
    """ids outside [0, E) (another rank's experts) contribute nothing; two calls agree bit for bit."""
    dtype = torch.float32
    w13, w2 = make_experts(4, 32, 16, dtype)
    x, weights, ids = make_routes(6, 4, 2, dtype, 32)
    ids[1, 0], ids[4, 1], ids[5] = -1, 7, 4
    got = fused_moe(x, w13, w2, weights, ids)
    assert relative_error(got, reference_moe(x, w13, w2, weights, ids)) < TOLERANCE[dtype]
    assert torch.equal(got[5], torch.zeros_like(got[5]))
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 2, 4), (3, 2, 4), (8, 4, 8)] +
                         ([(1, 8, 128), (8, 8, 128)] if CUDA else []))
def test_sum_in_the_w2_gemm_equals_the_separate_sum(monkeypatch, tokens, top_k, num_experts):
    """Up to SUM_IN_DOWN_MAX_TOKENS the w2 GEMM's last program of each column tile sums the choices: the same
    bits as the separate sum kernel (another rank's choices included), and every arrival count back to 0."""
    import shardserve.kernels.triton.fused_moe as kernels

    assert tokens <= kernels.SUM_IN_DOWN_MAX_TOKENS
    dtype = torch.bfloat16 if CUDA else torch.float32
    hidden, inter = (2048, 768) if num_experts == 128 else (80, 48)  # 80: a column tile past the hidden size
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x, weights, ids = make_routes(tokens, num_experts, top_k, dtype, hidden)
    ids[0, 0] = num_experts + 3  # a choice held by another rank
    config = pick_config(tokens, top_k, num_experts) if CUDA else SMALL  # the grouped GEMMs, one token too
    fused = fused_moe(x, w13, w2, weights, ids, config=config)
    assert arrivals_left_at_zero(x.device)
    monkeypatch.setattr(kernels, "SUM_IN_DOWN_MAX_TOKENS", 0)
    separate = fused_moe(x, w13, w2, weights, ids, config=config)
    assert torch.equal(fused, separate)
    assert relative_error(fused, reference_moe(x, w13, w2, weights, ids)) < TOLERANCE[dtype]


def test_table_reads_each_chosen_expert_once_at_decode():
    """Decode at the real shape takes the smallest row block; larger batches a block that covers an expert's
    rows."""
    num_experts, top_k, _, _ = QWEN3_30B
    assert pick_config(1, top_k, num_experts).block_m == pick_config(64, top_k, num_experts).block_m == 16
    assert pick_config(512, top_k, num_experts).block_m >= 32
    assert pick_config(8192, top_k, num_experts).block_m == 128


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_one_token_from_logits_replays_in_cuda_graph():
    """Batch-1 decode's launches (choice + alignment, w13, w2, sum) captured, replayed on new logits."""
    num_experts, top_k, hidden, inter = QWEN3_30B
    dtype = torch.bfloat16
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x = torch.randn(1, hidden, generator=g, device=DEVICE).to(dtype)
    logits = torch.randn(1, num_experts, generator=g, device=DEVICE)
    fused_moe_from_logits(x, logits, w13, w2, top_k, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_from_logits(x, logits, w13, w2, top_k, True)
    for seed in (6, 7):
        g.manual_seed(seed)
        x.copy_(torch.randn(1, hidden, generator=g, device=DEVICE))
        logits.copy_(torch.randn(1, num_experts, generator=g, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = route_reference(logits, top_k, True)
        assert relative_error(out, reference_moe(x, w13, w2, weights, ids)) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_replays_in_cuda_graph_with_new_routes():
    num_experts, top_k, hidden, inter, tokens = 128, 8, 256, 128, 16
    dtype = torch.bfloat16
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x, weights, ids = make_routes(tokens, num_experts, top_k, dtype, hidden, seed=1)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)

    new_x, new_weights, new_ids = make_routes(tokens, num_experts, top_k, dtype, hidden, seed=2)
    new_ids[:4] = new_ids[0]  # and a few tokens on the same experts
    for buffer, value in ((x, new_x), (weights, new_weights), (ids, new_ids)):
        buffer.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, reference_moe(new_x, w13, w2, new_weights, new_ids)) < TOLERANCE[dtype]
    assert torch.equal(out, fused_moe(new_x, w13, w2, new_weights, new_ids))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("path", ["gemm", "one_token"])
def test_sum_in_the_w2_gemm_over_many_replays(monkeypatch, path):
    """The arrival counts stay right over many replays of a graph of several layers' experts (each layer's w2
    product sums in its last programs, grouped GEMM or one-token path): every replay's output equals the separate
    sum's on the same routes."""
    import shardserve.kernels.triton.fused_moe as kernels

    num_experts, top_k, hidden, inter = QWEN3_30B
    dtype, layers = torch.bfloat16, 4
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    x = torch.randn(1, hidden, generator=g, device=DEVICE).to(dtype)
    logits = torch.randn(layers, 1, num_experts, generator=g, device=DEVICE).to(dtype)
    config = pick_config(1, top_k, num_experts) if path == "gemm" else ONE_TOKEN_TEST_TILES
    if path == "one_token":  # the separate sum below: no arrival counts
        real_counts = kernels.arrival_counts
        monkeypatch.setattr(kernels, "arrival_counts", lambda device, slots: (
            None if kernels.SUM_IN_DOWN_MAX_TOKENS == 0 else real_counts(device, slots)))

    def chain():
        h = x
        for layer in range(layers):
            h = fused_moe_from_logits(h, logits[layer], w13, w2, top_k, True, config=config) * 4
        return h

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in range(20):
        g.manual_seed(100 + seed)
        x.copy_(torch.randn(1, hidden, generator=g, device=DEVICE))
        logits.copy_(torch.randn(layers, 1, num_experts, generator=g, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        with monkeypatch.context() as m:
            m.setattr(kernels, "SUM_IN_DOWN_MAX_TOKENS", 0)
            assert torch.equal(out, chain()), f"replay {seed}"
    assert arrivals_left_at_zero(x.device)


def test_one_launch_routing_is_used_only_after_matching_the_reference(monkeypatch):
    """The start-up check of fused_moe_from_logits passes the kernel, and refuses one that drops a rank's expert
    offset (expert parallelism) or is one percent off."""
    import shardserve.kernels.triton.fused_moe as kernels
    from shardserve.layers.moe import _routed_matches

    w13, w2 = make_experts(4, 32, 16, torch.float32)
    assert _routed_matches(w13, w2, 8, 2, True)
    real = kernels.fused_moe_from_logits

    def without_offset(x, logits, w13, w2, top_k, renormalize, id_base=0, config=None):
        return real(x, logits, w13, w2, top_k, renormalize, 0, config)

    def one_percent_off(*args, **kwargs):
        return real(*args, **kwargs) * 1.01

    for wrong in (without_offset, one_percent_off):
        monkeypatch.setattr(kernels, "fused_moe_from_logits", wrong)
        assert not _routed_matches(w13, w2, 8, 2, True)


# ---------------------------------------------------------------------------------------------------------------
# One token: matrix-vector products

# Narrow tiles, so that the interpreter's small shapes take several programs and steps (and masked remainders).
ONE_TOKEN_SMALL = OneTokenTiles(Tile(4, 16, 4, 1), Tile(4, 16, 4, 1))
ONE_TOKEN_TEST_TILES = OneTokenTiles(Tile(4, 512, 4, 3), Tile(4, 256, 4, 2)) if CUDA else ONE_TOKEN_SMALL
ONE_TOKEN_SHAPES = [(8, 2, 48, 24), (4, 3, 40, 20)] + ([QWEN3_30B, (128, 8, 256, 384)] if CUDA else [])


@pytest.mark.parametrize("num_experts,top_k,hidden,inter", ONE_TOKEN_SHAPES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_one_token_path_matches_reference_and_the_grouped_gemms(num_experts, top_k, hidden, inter, ids_dtype):
    """A single token's matrix-vector experts agree with float64 and with the grouped GEMMs (to rounding: the
    products sum in another order), with a choice of another rank's expert among them; results repeat exactly."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x, weights, ids = make_routes(1, num_experts, top_k, dtype, hidden, ids_dtype=ids_dtype)
    ids[0, -1] = num_experts + 2  # held by another rank: adds nothing
    got = fused_moe(x, w13, w2, weights, ids, config=ONE_TOKEN_TEST_TILES)
    want = reference_moe(x, w13, w2, weights, ids)
    assert relative_error(got, want) < TOLERANCE[dtype]
    grouped = fused_moe(x, w13, w2, weights, ids, config=pick_config(1, top_k, num_experts))
    assert relative_error(got, grouped.double()) < TOLERANCE[dtype]
    assert torch.equal(got, fused_moe(x, w13, w2, weights, ids, config=ONE_TOKEN_TEST_TILES))
    assert arrivals_left_at_zero(x.device)


def arrivals_left_at_zero(device) -> bool:
    from shardserve.kernels.triton import arrivals

    return arrivals._counts[device].count_nonzero().item() == 0


def test_one_token_path_is_the_default_for_a_single_token(set_env):
    """Without a config a single token takes the one-token path (the same bits as asking for it);
    SHARDSERVE_MOE_ONE_TOKEN=gemm keeps the grouped GEMMs, and a bad value names the variable."""
    from shardserve.kernels import fused_moe_table

    dtype = torch.float32
    w13, w2 = make_experts(8, 48, 24, dtype)
    x, weights, ids = make_routes(1, 8, 2, dtype, 48)
    tiles = fused_moe_table.ONE_TOKEN_TILES
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids, config=tiles))
    set_env({fused_moe_table.ONE_TOKEN_ENV: "gemm"})
    assert torch.equal(fused_moe(x, w13, w2, weights, ids),
                       fused_moe(x, w13, w2, weights, ids, config=pick_config(1, 2, 8, 4)))
    set_env({fused_moe_table.ONE_TOKEN_ENV: "matvec"})
    with pytest.raises(ValueError, match="SHARDSERVE_MOE_ONE_TOKEN='matvec': expected one of gemv, gemm"):
        fused_moe(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="single token"):
        x2, weights2, ids2 = make_routes(2, 8, 2, dtype, 48)
        fused_moe(x2, w13, w2, weights2, ids2, config=tiles)
    # Other tiles by name (tuning inside whole steps): the path runs them; a malformed value names the variable.
    set_env({fused_moe_table.ONE_TOKEN_ENV: "gemv"})
    set_env({fused_moe_table.ONE_TOKEN_TILES_ENV: "4,16,4,1/16,8,4,1"})
    other = fused_moe_table.OneTokenTiles(fused_moe_table.Tile(4, 16, 4, 1), fused_moe_table.Tile(16, 8, 4, 1))
    assert fused_moe_table.one_token_tiles() == other
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids, config=other))
    set_env({fused_moe_table.ONE_TOKEN_TILES_ENV: "4,16,4,1"})
    with pytest.raises(ValueError, match="SHARDSERVE_MOE_ONE_TOKEN_TILES='4,16,4,1': expected two tiles"):
        fused_moe(x, w13, w2, weights, ids)


def test_one_token_sum_in_the_w2_product_equals_the_separate_sum(monkeypatch):
    """Where no arrival counts are to be had a kernel of its own sums the choices: the same bits; and the w2
    product's weight tiles loaded before the wait give the same bits as loaded after it."""
    import shardserve.kernels.triton.fused_moe as kernels

    dtype = torch.bfloat16 if CUDA else torch.float32
    num_experts, top_k, hidden, inter = ONE_TOKEN_SHAPES[-1]
    w13, w2 = make_experts(num_experts, hidden, inter, dtype)
    x, weights, ids = make_routes(1, num_experts, top_k, dtype, hidden)
    ids[0, 0] = -1
    fused = fused_moe(x, w13, w2, weights, ids, config=ONE_TOKEN_TEST_TILES)
    monkeypatch.setattr(kernels, "arrival_counts", lambda device, slots: None)
    assert torch.equal(fused, fused_moe(x, w13, w2, weights, ids, config=ONE_TOKEN_TEST_TILES))
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "ONE_TOKEN_PRELOAD_TILES", 0)
    assert torch.equal(fused, fused_moe(x, w13, w2, weights, ids, config=ONE_TOKEN_TEST_TILES))


@pytest.mark.parametrize("held", [None, (0, 4), (4, 8)])
def test_one_token_from_logits_with_this_ranks_experts(held):
    """The router's choice then the one-token path, for all experts or one rank's half (expert parallelism: the
    ids keep their global numbers, the kernels subtract the rank's first); the halves add up to the whole."""
    got = check_from_logits(1, 8, 2, 48, 24, torch.float32, held=held, config=ONE_TOKEN_SMALL)
    if held == (4, 8):
        first = check_from_logits(1, 8, 2, 48, 24, torch.float32, held=(0, 4), config=ONE_TOKEN_SMALL)
        whole = check_from_logits(1, 8, 2, 48, 24, torch.float32, config=ONE_TOKEN_SMALL)
        assert torch.equal(first + got, whole)  # two choices: one float32 addition either way


# ---------------------------------------------------------------------------------------------------------------
# Non-gated experts (NemotronH's): w13 holds only the up rows, the activation applies to them alone


def reference_non_gated(x, w1, w2, weights, ids, activation: str) -> torch.Tensor:
    act = (lambda u: torch.relu(u).square()) if activation == "relu2" else F.silu
    x, w1, w2, weights = x.double(), w1.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for expert in range(w1.shape[0]):
        token, choice = (ids == expert).nonzero(as_tuple=True)
        if token.numel():
            out.index_add_(0, token, act(x[token] @ w1[expert].T) @ w2[expert].T * weights[token, choice, None])
    return out


@pytest.mark.parametrize("activation", ["relu2", "silu"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_non_gated_experts_equal_float64(activation, tokens):
    """The grouped GEMMs and, for one token, the matrix-vector path; choices of another rank's experts (ids past E,
    as expert parallelism leaves them) add nothing; an inter size off the tiles' multiple."""
    num_experts, top_k, hidden, inter = 6, 3, 48, 40
    g = torch.Generator(device=DEVICE).manual_seed(3)
    w1 = (torch.randn(num_experts, inter, hidden, generator=g, device=DEVICE) * hidden ** -0.5).float()
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=DEVICE) * inter ** -0.5).float()
    x, weights, ids = make_routes(tokens, num_experts + 2, top_k, torch.float32, hidden)
    config = ONE_TOKEN_SMALL if tokens == 1 else SMALL
    got = fused_moe(x, w1, w2, weights, ids, config=config, activation=activation)
    want = reference_non_gated(x, w1, w2, weights, ids, activation)
    assert (ids >= num_experts).any() or tokens == 1
    error = relative_error(got, want)
    assert error < TOLERANCE[torch.float32], f"{activation}: relative error {error:.3g} at T={tokens}"


def test_non_gated_shapes_are_checked_by_activation():
    w1, w2 = torch.zeros(2, 8, 16, device=DEVICE), torch.zeros(2, 16, 8, device=DEVICE)
    x, weights, ids = make_routes(2, 2, 1, torch.float32, 16)
    with pytest.raises(ValueError, match=r"w2 must be \[2, 16, 4\] for swiglu experts"):
        fused_moe(x, w1, w2, weights, ids)
    with pytest.raises(ValueError, match="activation 'gelu': use one of swiglu, relu2, silu"):
        fused_moe(x, w1, w2, weights, ids, activation="gelu")
