"""The grouped router's kernel chooses the same experts as torch's grouped_top_k (layers/grouped_topk.py), with the
same weights up to rounding: sigmoid scores with a correction bias (NemotronH, DeepSeek-V3) and softmax ones
(DeepSeek-V2), with and without expert groups; and GroupedTopKRouter uses it only past its check.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import logging
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve import envs  # noqa: E402
from shardserve.config import GroupedTopK  # noqa: E402
from shardserve.kernels.triton import grouped_router  # noqa: E402
from shardserve.kernels.triton.grouped_router import grouped_route  # noqa: E402
from shardserve.layers import grouped_topk  # noqa: E402
from shardserve.layers.grouped_topk import GroupedTopKRouter, grouped_top_k  # noqa: E402
from shardserve.layers.moe import by_expert  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_inputs(route: GroupedTopK, tokens: int, bias: bool, seed: int = 0):
    """float32 logits [tokens, E] and a bias [E] (or None): no ties, so one right set of experts a token."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(tokens, route.num_experts, generator=g, device=DEVICE) * 2
    return logits, (torch.randn(route.num_experts, generator=g, device=DEVICE) * 0.2 if bias else None)


def assert_as_torch(route: GroupedTopK, logits, bias):
    weights, ids = grouped_route(logits, bias, route)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], route.top_k)
    weights, ids = by_expert(weights, ids)
    want_weights, want_ids = by_expert(*grouped_top_k(logits, bias, route))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    return ids


CASES = {
    # (route, bias): NemotronH / DeepSeek-V3 (noaux_tc), V2 (greedy, group_limited_greedy), tiny test models
    "sigmoid": (GroupedTopK(8, 2), True),
    "sigmoid-5-experts": (GroupedTopK(5, 3, renormalize=False), True),
    "sigmoid-6-experts-scaled": (GroupedTopK(6, 2, scaling_factor=2.5), True),
    "sigmoid-no-bias": (GroupedTopK(8, 3), False),
    "sigmoid-groups": (GroupedTopK(32, 4, 8, 4, scaling_factor=2.5), True),
    "sigmoid-3-groups-not-renormalized": (GroupedTopK(12, 3, 3, 2, renormalize=False, scaling_factor=1.5), True),
    "softmax": (GroupedTopK(6, 2, renormalize=False, scoring="softmax"), False),
    "softmax-renormalized": (GroupedTopK(7, 3, scoring="softmax"), False),
    "softmax-groups": (GroupedTopK(20, 3, 4, 2, renormalize=False, scaling_factor=16.0, scoring="softmax"), False),
    "softmax-groups-of-one": (GroupedTopK(8, 2, 8, 3, scoring="softmax"), False),
    "softmax-bias": (GroupedTopK(16, 4, 4, 2, scoring="softmax"), True),
}


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_same_experts_and_weights_as_grouped_top_k(case, tokens):
    route, bias = CASES[case]
    assert_as_torch(route, *random_inputs(route, tokens, bias, seed=tokens))


@pytest.mark.parametrize("route", [GroupedTopK(64, 6, scaling_factor=2.446),  # Moonlight-16B-A3B
                                   GroupedTopK(128, 8, 8, 4, scaling_factor=2.5),  # DeepSeek-V3's groups
                                   GroupedTopK(160, 6, 8, 3, False, 16.0, "softmax")],  # DeepSeek-V2's
                         ids=["64-experts", "128-experts-8-groups", "160-experts-softmax-groups"])
def test_realistic_routes(route):
    assert_as_torch(route, *random_inputs(route, 9, route.scoring == "sigmoid"))


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_the_groups_change_the_choice(scoring):
    """Where the dropped groups hold experts whose scores would have been chosen, the kernel drops them as torch
    does: a kernel ignoring the groups would fail here."""
    route = GroupedTopK(32, 4, 8, 2, scoring=scoring)
    logits, bias = random_inputs(route, 6, scoring == "sigmoid", seed=3)
    ids = assert_as_torch(route, logits, bias)
    ungrouped = by_expert(*grouped_top_k(logits, bias, GroupedTopK(32, 4, scoring=scoring)))[1]
    assert not torch.equal(ids, ungrouped)
    assert all(len(set(row)) <= 2 for row in (ids // 4).tolist())  # from at most topk_groups groups


def test_the_bias_chooses_and_never_weighs():
    """A large bias on experts with the lowest scores makes them the choice; their weights are their own (low)
    sigmoid scores, renormalised."""
    route = GroupedTopK(8, 2)
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]], device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    bias[[6, 7]] = 10.0
    weights, ids = by_expert(*grouped_route(logits, bias, route))
    assert ids.tolist() == [[6, 7]]
    scores = torch.sigmoid(logits[0, 6:])
    torch.testing.assert_close(weights[0], scores / scores.sum())


def test_ties_pick_the_lower_expert_and_the_lower_group():
    """Equal scores: the lower expert index first, in choice order; equal groups: the lower groups stay."""
    weights, ids = grouped_route(torch.zeros(2, 16, device=DEVICE), None, GroupedTopK(16, 4, 4, 2))
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    torch.testing.assert_close(weights, torch.full((2, 4), 0.25, device=DEVICE))
    logits = torch.zeros(1, 16, device=DEVICE)
    logits[0, [5, 9, 13]] = 1.0  # groups 1, 2 and 3 worth the same: groups 1 and 2 stay
    _, ids = grouped_route(logits, None, GroupedTopK(16, 4, 4, 2))
    assert ids.tolist() == [[5, 9, 4, 6]]
    _, ids = grouped_route(logits, None, GroupedTopK(16, 4, 4, 2, scoring="softmax"))
    assert ids.tolist() == [[5, 9, 4, 6]]


@pytest.mark.parametrize("num_warps", [1, 2, 4])
def test_the_launchs_warps_change_nothing(num_warps):
    route = GroupedTopK(64, 6, 4, 2, scaling_factor=2.5)
    logits, bias = random_inputs(route, 3, True, seed=4)
    weights, ids = grouped_route(logits, bias, route, num_warps=num_warps)
    want_weights, want_ids = grouped_route(logits, bias, route, num_warps=1)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_a_strided_view_no_tokens_and_bad_shapes():
    route = GroupedTopK(10, 3)
    logits, bias = random_inputs(route, 8, True)
    assert_as_torch(route, logits[::2], bias)
    weights, ids = grouped_route(logits[:0], bias, route)
    assert weights.shape == ids.shape == (0, 3)
    with pytest.raises(ValueError, match="logits for 10 experts"):
        grouped_route(logits, bias, GroupedTopK(12, 3))
    with pytest.raises(ValueError, match="at most 512 experts"):
        grouped_route(torch.zeros(1, 1024, device=DEVICE), None, GroupedTopK(1024, 2))


def test_the_check_refuses_a_kernel_that_differs(monkeypatch, caplog):
    """A kernel choosing another expert fails the router's check (logged as an error): torch keeps routing."""
    def off_by_one(logits, bias, route):
        weights, ids = grouped_top_k(logits, bias, route)
        return weights, (ids + 1) % route.num_experts

    monkeypatch.setattr(grouped_router, "grouped_route", off_by_one)
    with caplog.at_level(logging.ERROR, logger=grouped_topk.__name__):
        assert not grouped_topk._kernel_matches(torch.device(DEVICE), GroupedTopK(8, 2), True)
    assert "differs from torch's grouped_top_k" in caplog.text


def test_the_check_passes_on_the_real_kernel_and_the_variable_turns_it_off(monkeypatch):
    route = GroupedTopK(8, 2, 2, 1, scaling_factor=2.5)
    monkeypatch.setattr(grouped_topk, "_kernel_checked", {})
    with envs.override(SHARDSERVE_DEVICE_EXPERTS="0"):
        assert not grouped_topk.device_grouped_router(torch.device(DEVICE), route, True)
    assert not grouped_topk._kernel_checked  # not decided for good by the variable
    assert grouped_topk.device_grouped_router(torch.device(DEVICE), route, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the router uses the kernel on CUDA tensors only")
def test_the_router_routes_with_the_kernel_on_cuda(monkeypatch):
    route = GroupedTopK(64, 6, 8, 4, scaling_factor=2.5)
    router = GroupedTopKRouter(32, route).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    router.weight.data = torch.randn(64, 32, generator=g, device="cuda")
    router.e_score_correction_bias.data = torch.randn(64, generator=g, device="cuda") * 0.1
    h = torch.randn(17, 32, generator=g, device="cuda").to(torch.bfloat16)
    assert grouped_topk.device_grouped_router(h.device, route, True)  # the check, before counting the calls
    calls = []
    monkeypatch.setattr(grouped_router, "grouped_route",
                        lambda *args, _route=grouped_route, **kwargs: calls.append(1) or _route(*args, **kwargs))
    weights, ids = by_expert(*router(h))
    assert calls == [1]
    logits = torch.nn.functional.linear(h.float(), router.weight)
    want_weights, want_ids = by_expert(*grouped_top_k(logits, router.e_score_correction_bias, route))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("experts, hidden", [(8, 64), (6, 96), (5, 1100)])
def test_a_single_tokens_router_logits_are_float32_products_of_a_16_bit_row(dtype, experts, hidden):
    """The batch-1 GEMV into float32 logits (router_logits' one-launch form): a 16-bit or float32 row times the
    float32 router weight, within 1e-5 of float64, with the whole row loaded before the dependent-launch wait (as
    routers run) or one tile of it (1100 columns: three tiles of 512, the last partial); its check passes on the
    real kernel."""
    from shardserve.kernels.triton.gemv import gemv_float32_out

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(experts, hidden, generator=g).to(DEVICE)
    h = torch.randn(1, hidden, generator=g).to(dtype).to(DEVICE)
    for preload in (grouped_topk.ROUTER_GEMV_PRELOAD, 1):
        got = gemv_float32_out(h, weight, grouped_topk.ROUTER_GEMV_BLOCK_N, preload=preload)
        assert got.dtype == torch.float32 and got.shape == (1, experts)
        torch.testing.assert_close(got.double(), h.double() @ weight.double().T, rtol=1e-5, atol=1e-5)
    assert grouped_topk._router_gemv_matches(weight)
