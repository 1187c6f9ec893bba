"""The router's GEMV that also makes the router's choice (kernels/triton/router_gemv.py) gives the two launches it
replaces bit for bit: the batch-1 GEMV (norm-fused or plain) and route_top_k on its logits; and a single token's
MoE layer takes it only where it passed its start-up check, with the same output as the two launches.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (small K, several programs a launch).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from shardserve.kernels.triton.gemv import gemv, gemv_rmsnorm  # noqa: E402
from shardserve.kernels.triton.moe_router import route_top_k  # noqa: E402
from shardserve.kernels.triton.router_gemv import gemv_rmsnorm_route, gemv_route  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
HIDDEN = 64  # two tiles of BLOCK_K, the first loaded before the dependent-launch wait


def arrivals_left_at_zero() -> bool:
    from shardserve.kernels.triton import arrivals

    return all(counts.count_nonzero().item() == 0 for counts in arrivals._counts.values())


def router_inputs(num_experts, hidden=HIDDEN, seed=0):
    """(x, residual, norm weight, router weight) of one token."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(1, hidden, generator=g, device=DEVICE).to(DTYPE)
    residual = torch.randn(1, hidden, generator=g, device=DEVICE).to(DTYPE)
    norm_weight = torch.rand(hidden, generator=g, device=DEVICE).add_(0.5).to(DTYPE)
    w = (torch.randn(num_experts, hidden, generator=g, device=DEVICE) * hidden ** -0.5).to(DTYPE)
    return x, residual, norm_weight, w


def assert_same_bits(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (60, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("block_n", [8, 32])
def test_norm_fused_form_equals_the_gemv_then_the_router(num_experts, top_k, renormalize, with_residual, block_n):
    """Logits, the new residual, the normed row, the weights and the ids: the norm-fused GEMV's and route_top_k's
    bits, from 2 to 16 programs counting in; twice in a row (the count back at 0 in between)."""
    x, residual, norm_weight, w = router_inputs(num_experts)
    residual = residual if with_residual else None
    config = (block_n, 32, 4, 1)
    product = gemv_rmsnorm(x, residual, norm_weight, 1e-6, w, *config, keep_normed=True)
    want = (*product, *route_top_k(product[0], top_k, renormalize))
    for _ in range(2):
        assert_same_bits(gemv_rmsnorm_route(x, residual, norm_weight, 1e-6, w, top_k, renormalize, *config), want)
        assert arrivals_left_at_zero()
    assert want[3].dtype == torch.float32 and want[4].dtype == torch.int64


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(128, 8, True), (60, 2, False)])
def test_plain_form_equals_the_gemv_then_the_router(num_experts, top_k, renormalize):
    """An input already normed (the all-reduce applied the norm): the plain GEMV's logits and route_top_k's choice."""
    x, _, _, w = router_inputs(num_experts, seed=1)
    config = (8, 32, 4, 1)
    logits = gemv(x, w, *config)
    want = (logits, *route_top_k(logits, top_k, renormalize))
    for _ in range(2):
        assert_same_bits(gemv_route(x, w, top_k, renormalize, *config), want)
        assert arrivals_left_at_zero()


@pytest.mark.parametrize("fused_norm", [True, False])
def test_a_folded_shared_experts_gate_is_the_last_choice(fused_norm):
    """A router whose last row is a folded shared expert's gate (layers/moe_shared.py): the choice is over the
    other rows, and the shared expert (expert E) comes last with weight sigmoid(its logit), as route_top_k's
    `shared` makes it, bit for bit."""
    num_experts, top_k = 60, 4
    x, residual, norm_weight, w = router_inputs(num_experts + 1, seed=6)
    config = (8, 32, 4, 1)
    if fused_norm:
        product = gemv_rmsnorm(x, residual, norm_weight, 1e-6, w, *config, keep_normed=True)
        got = gemv_rmsnorm_route(x, residual, norm_weight, 1e-6, w, top_k, True, *config, shared=True)
    else:
        product = (gemv(x, w, *config),)
        got = gemv_route(x, w, top_k, True, *config, shared=True)
    assert_same_bits(got, (*product, *route_top_k(product[0], top_k, True, True)))
    assert arrivals_left_at_zero()
    weights, ids = got[-2:]
    assert ids.shape == (1, top_k + 1) and ids[0, -1] == num_experts and ids[0, :-1].max() < num_experts
    assert torch.allclose(weights[0, -1], torch.sigmoid(got[0][0, -1].float()), rtol=1e-6)


def test_ties_pick_the_lower_expert():
    """Experts 5, 9 and 40 with equal, largest logits (equal weight rows), the rest at 0: the choice takes them in
    index order, then the lowest-numbered of the zeros, as route_token does in a launch of its own."""
    num_experts, top_k = 60, 8
    x, _, norm_weight, _ = router_inputs(num_experts, seed=2)
    x, norm_weight = x.abs(), norm_weight.abs()  # a positive normed row: the tied rows' logits are the largest
    w = torch.zeros(num_experts, HIDDEN, device=DEVICE, dtype=DTYPE)
    w[[5, 9, 40]] = 0.5
    logits, _, _, weights, ids = gemv_rmsnorm_route(x, None, norm_weight, 1e-6, w, top_k, True, 16, 32, 4, 1)
    assert ids.tolist() == [[5, 9, 40, 0, 1, 2, 3, 4]]
    assert logits[0, 5] == logits[0, 9] == logits[0, 40] > 0
    assert_same_bits((weights, ids), route_top_k(logits, top_k, True))


def test_no_arrival_counts_no_launch(monkeypatch):
    """Where the device's arrival counts would first be made inside a CUDA graph capture there is no such launch:
    None, and the caller keeps the two launches."""
    import shardserve.kernels.triton.router_gemv as router_gemv

    x, residual, norm_weight, w = router_inputs(8)
    monkeypatch.setattr(router_gemv, "arrival_counts", lambda device, slots: None)
    assert gemv_rmsnorm_route(x, residual, norm_weight, 1e-6, w, 2, True, 4, 32, 4, 1) is None
    assert gemv_route(x, w, 2, True, 4, 32, 4, 1) is None


def test_start_up_check_passes_the_kernel_and_refuses_one_bit_off(monkeypatch):
    """The check behind the MoE layer's use of the one-launch form: the kernel passes, norm-fused and plain; a
    form whose weights are one float32 step off, or whose logits are, is refused."""
    import shardserve.kernels.triton.router_gemv as router_gemv
    from shardserve.layers.moe import _router_gemv_matches

    weight = torch.empty(8, HIDDEN, dtype=DTYPE, device=DEVICE)
    config = (4, 32, 4, 1)
    assert _router_gemv_matches(weight, config, True, 2, True)
    assert _router_gemv_matches(weight, config, False, 2, False)
    real = router_gemv.gemv_rmsnorm_route

    def weights_off(*args):
        logits, summed, normed, weights, ids = real(*args)
        return logits, summed, normed, torch.nextafter(weights, torch.ones_like(weights)), ids

    def logits_off(*args):
        logits, *rest = real(*args)
        return (logits * 1.01, *rest)

    for wrong in (weights_off, logits_off):
        monkeypatch.setattr(router_gemv, "gemv_rmsnorm_route", wrong)
        assert not _router_gemv_matches(weight, config, True, 2, True)


# ---------------------------------------------------------------------------------------------------------------
# The MoE layer


class TwoRanks:
    """A stand-in for a two-rank communicator whose ranks hold the same partial sum: the all-reduce doubles x;
    `fuses`: it also adds the residual and norms in the same step (Communicator.all_reduce_add_rms_norm)."""

    def __init__(self, fuses: bool) -> None:
        self.fuses = fuses

    def all_reduce(self, x):
        return x * 2

    def all_reduce_add_rms_norm(self, x, residual, weight, eps):
        if not self.fuses:
            return None
        from shardserve.kernels.triton.fused_ops import fused_add_rms_norm

        return fused_add_rms_norm(x * 2, residual.clone(), weight, eps)


def moe_layer(renormalize=True, held=(0, 8)):
    """A MoE block of 8 experts (top 2) whose router has Triton forms chosen for its shape, with random weights;
    `held`: the experts this rank computes."""
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.cuda_gemv import Batch1GemvKernel
    from shardserve.layers.moe import SparseMoE
    from shardserve.layers.norm import RMSNorm

    num_experts, inter = 8, 32
    layer = SparseMoE(HIDDEN, inter, num_experts, 2, renormalize, Communicator(None, 0, 1), DTYPE).to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    e0, e1 = held
    layer.experts_held = held
    layer.w13 = torch.nn.Parameter((torch.randn(e1 - e0, 2 * inter, HIDDEN, generator=g, device=DEVICE)
                                    * HIDDEN ** -0.5).to(DTYPE), requires_grad=False)
    layer.w2 = torch.nn.Parameter((torch.randn(e1 - e0, HIDDEN, inter, generator=g, device=DEVICE)
                                   * inter ** -0.5).to(DTYPE), requires_grad=False)
    layer.gate.weight.data.copy_(torch.randn(num_experts, HIDDEN, generator=g, device=DEVICE) * 0.5)
    config = (4, 32, 4, 1)
    layer.gate.kernel = Batch1GemvKernel({(num_experts, HIDDEN): config}, {}, {(num_experts, HIDDEN): config})
    norm = RMSNorm(HIDDEN, 1e-6, DTYPE).to(DEVICE)
    norm.weight.data.copy_(torch.rand(HIDDEN, generator=g, device=DEVICE).add_(0.5))
    return layer, norm


def from_logits(layer, h, logits):
    """The block's routed experts as a single token on CUDA takes them after the router's GEMV: fused_moe_from_logits
    (the choice in a launch of its own, then the one-token experts)."""
    from shardserve.kernels.triton.fused_moe import fused_moe_from_logits

    return fused_moe_from_logits(h, logits, layer.w13, layer.w2, layer.top_k, layer.renormalize,
                                 layer.experts_held[0])


def two_launches(layer, x, residual, norm, reduce):
    """The block's routed experts and new residual with the separate choice: the router's GEMV, then from_logits."""
    logits, h, residual = layer.gate.forward_normed(x, residual, norm, reduce, keep_normed=True)
    return from_logits(layer, h, logits), residual


def as_on_cuda(monkeypatch, set_env):
    """The choice in the router's launch turned on (SHARDSERVE_MOE_ROUTE=gemv); without CUDA, the layer's CUDA paths
    in the interpreter (the choice in the router's launch where it may, else fused_moe_from_logits)."""
    from shardserve.layers.moe import ROUTE_ENV, SparseMoE

    set_env({ROUTE_ENV: "gemv"})
    if not CUDA:
        monkeypatch.setattr(SparseMoE, "routes_in_router", lambda self, x: True)
        monkeypatch.setattr(SparseMoE, "routed_experts", from_logits)


@pytest.mark.parametrize("case", ["whole", "second half of the experts", "not renormalised", "normed input",
                                  "all-reduced first", "all-reduced and normed first", "no arrival counts"])
def test_layer_routing_in_the_router_gemv_equals_the_two_launches(monkeypatch, set_env, case):
    """A single token through the block with the choice in the router's launch: the same output and residual, bit
    for bit, as the router's GEMV followed by fused_moe_from_logits; for all experts and for a rank holding experts
    4 to 7 (expert parallelism), on an input already normed (reduce NORMED: the plain form), on a partial sum
    all-reduced first (plain, or with the add and the norm: as ColumnParallelLinear.forward_normed would), and
    where no arrival counts are to be had (the two launches)."""
    import shardserve.kernels.triton.router_gemv as router_gemv
    from shardserve.distributed.communicator import NORMED
    from shardserve.layers import moe

    monkeypatch.setattr(moe, "_router_gemv_checked", {})
    layer, norm = moe_layer(renormalize=case != "not renormalised",
                            held=(4, 8) if case == "second half of the experts" else (0, 8))
    reduce = {"normed input": NORMED, "all-reduced first": TwoRanks(False),
              "all-reduced and normed first": TwoRanks(True)}.get(case)
    if case == "no arrival counts":
        monkeypatch.setattr(router_gemv, "arrival_counts", lambda device, slots: None)
    x, residual, _, _ = router_inputs(8, seed=4)
    want = two_launches(layer, x.clone(), residual.clone(), norm, reduce)
    as_on_cuda(monkeypatch, set_env)
    launches = []
    real = router_gemv._launch
    monkeypatch.setattr(router_gemv, "_launch", lambda *args: launches.append(real(*args)) or launches[-1])
    for _ in range(2):  # the first step runs the start-up check
        launches.clear()
        assert_same_bits(layer(x.clone(), residual.clone(), norm, reduce), want)
    assert len(launches) == 1 and (launches[0] is None) == (case == "no arrival counts")


def test_layer_keeps_the_two_launches_without_a_triton_form_or_when_told(monkeypatch, set_env):
    """No norm-fused Triton form for the router's shape: no launch of the one-launch form; SHARDSERVE_MOE_ROUTE
    takes gemv (the default) or separate, and names itself on a bad value."""
    import shardserve.kernels.triton.router_gemv as router_gemv
    from shardserve.layers import moe
    from shardserve.layers.cuda_gemv import Batch1GemvKernel

    layer, norm = moe_layer()
    layer.gate.kernel = Batch1GemvKernel({}, {}, {})
    x, residual, _, _ = router_inputs(8, seed=5)
    want = two_launches(layer, x.clone(), residual.clone(), norm, None)
    as_on_cuda(monkeypatch, set_env)
    monkeypatch.setattr(router_gemv, "_launch", None)  # never called
    assert_same_bits(layer(x.clone(), residual.clone(), norm), want)
    set_env({moe.ROUTE_ENV: None})
    assert not moe.route_in_router_gemv()  # measured slower: not the default
    set_env({moe.ROUTE_ENV: "gemv"})
    assert moe.route_in_router_gemv()
    set_env({moe.ROUTE_ENV: "fused"})
    with pytest.raises(ValueError, match="SHARDSERVE_MOE_ROUTE='fused': expected one of gemv, separate"):
        moe.route_in_router_gemv()
