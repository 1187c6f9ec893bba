"""The fused router kernel chooses the same experts as torch's softmax + topk, with the same weights.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.triton.moe_router import route_top_k  # noqa: E402
from shardserve.layers.moe import by_expert, route_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (60, 4), (128, 8), (8, 8), (3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_same_experts_and_weights_as_softmax_topk(num_experts, top_k, renormalize, dtype):
    """Distinct logits per token (bfloat16 ones: sixteenths of a permutation, exact), so the top k is one set;
    the order of the k choices does not matter to the layer."""
    g = torch.Generator(device=DEVICE).manual_seed(num_experts * top_k)
    if dtype in (torch.float32, torch.float64):
        logits = (torch.randn(33, num_experts, generator=g, device=DEVICE) * 3).to(dtype)
    else:
        logits = torch.stack([torch.randperm(num_experts, generator=g, device=DEVICE) for _ in range(33)])
        logits = ((logits - num_experts // 2) / 16).to(dtype)
    weights, ids = by_expert(*route_top_k(logits, top_k, renormalize))
    want_weights, want_ids = by_expert(*route_reference(logits, top_k, renormalize))
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(33, device=DEVICE))


def test_ties_pick_the_lower_expert_and_no_expert_twice():
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[1, [2, 5, 6]] = 1.0
    weights, ids = route_top_k(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3], [2, 5, 6, 0]]
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_negative_and_positive_zero_logits_tie_and_negatives_order_by_value(dtype):
    """The choice compares logits as numbers: -0.0 ties with 0.0 (the lower index first), and among negative
    logits the one nearer zero ranks higher."""
    logits = torch.tensor([[-0.0, -2.0, 0.0, -0.5, -1.0, -0.0, -3.0, -0.25]], dtype=dtype, device=DEVICE)
    _, ids = route_top_k(logits, 8, renormalize=True)
    assert ids.tolist() == [[0, 2, 5, 7, 3, 4, 1, 6]]


def test_a_strided_view_and_a_bad_k():
    logits = torch.randn(16, 10, device=DEVICE)[::2]
    torch.testing.assert_close(route_top_k(logits, 3, False)[0], route_reference(logits, 3, False)[0])
    with pytest.raises(ValueError, match="top_k must be in"):
        route_top_k(logits, 11, False)


@pytest.mark.parametrize("num_experts", [3, 8, 60, 128])
def test_every_expert_chosen_once_in_order_even_past_the_finite_logits(num_experts):
    """k as large as the experts, over logits with many ties and with -inf ones: each expert is chosen once, ties
    to the lower index, -inf logits last in index order (a chosen -inf expert is still the maximum of what is
    left, so it must leave the round's candidates by its index, not by its logit)."""
    g = torch.Generator(device=DEVICE).manual_seed(num_experts)
    logits = torch.randint(0, 5, (4, num_experts), generator=g, device=DEVICE).float()  # many ties
    logits[1, ::2] = float("-inf")
    logits[2] = 0.0
    logits[3] = float("-inf")
    logits[3, -1] = 1.0  # one finite logit: the rest follow it in index order
    _, ids = route_top_k(logits.to(torch.bfloat16), num_experts, renormalize=True)
    for row, chosen in zip(logits.cpu(), ids.cpu()):
        want = sorted(range(num_experts), key=lambda e: (-float(row[e]), e))
        assert chosen.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_a_folded_shared_experts_gate_is_every_tokens_last_choice(dtype, renormalize):
    """With a shared expert folded into the experts (layers/moe_shared.py), the logits' last column is its gate:
    the top k come from the E others, and choice k is expert E weighted by sigmoid(gate), as route_with_shared."""
    from shardserve.layers.moe import route_with_shared

    g = torch.Generator(device=DEVICE).manual_seed(5)
    logits = (torch.randn(9, 13, generator=g, device=DEVICE) * 3).to(dtype)
    logits[0, 12] = logits.max() + 1  # the gate's logit above every expert's: still never a routed choice
    weights, ids = route_top_k(logits, 3, renormalize, shared=True)
    want_weights, want_ids = route_with_shared(logits, 3, renormalize)
    assert ids.shape == (9, 4) and ids[:, 3].tolist() == [12] * 9 and (ids[:, :3] < 12).all()
    assert torch.equal(by_expert(weights[:, :3], ids[:, :3])[1], by_expert(want_weights[:, :3], want_ids[:, :3])[1])
    torch.testing.assert_close(by_expert(weights, ids)[0], by_expert(want_weights, want_ids)[0], rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(weights[:, 3], torch.sigmoid(logits[:, 12].float()))
