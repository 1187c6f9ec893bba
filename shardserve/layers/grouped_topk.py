"""Grouped top-k routing with sigmoid scores and a score-correction bias: NemotronH's mixture of experts (transformers'
NemotronHTopkRouter), and DeepSeek-V3's, which routes the same way; and DeepSeek-V2's with softmax scores.

For each token: scores = sigmoid(router logits), in float32. The experts are chosen on scores + bias (the checkpoint's
`e_score_correction_bias`, which balances the experts' load): the experts fall into `num_groups` equal groups in order,
a group's worth is the sum of its two best biased scores, the `topk_groups` best groups stay, and the top_k best
biased scores among their experts are the choice. The weights are the chosen experts' unbiased scores, divided by
their sum (+ 1e-20) where `renormalize`, then times `scaling_factor`. The bias only chooses; it never weighs.

Softmax scoring (DeepSeek-V2's greedy and group_limited_greedy): scores = softmax(logits) over all experts, no
bias, a group's worth is its best score, and the chosen scores are the weights (renormalised only where `renormalize`).

The router is replicated: every rank routes every token to the same experts, whatever it holds of them.

On CUDA the choice runs in one Triton launch (kernels/triton/grouped_router.py; about ten torch launches
otherwise) where, once per device and route, it chose the same experts as grouped_top_k with weights within 1e-5
on random logits (device_grouped_router); a mismatch is logged and torch keeps routing. SHARDSERVE_DEVICE_EXPERTS=0
keeps torch too.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shardserve import envs
from shardserve.config import GroupedTopK
from shardserve.layers.linear import empty_parameter, load_whole
from shardserve.layers.moe import by_expert

logger = logging.getLogger(__name__)


def grouped_top_k(logits: torch.Tensor, correction_bias: torch.Tensor | None,
                  route: GroupedTopK) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) for router logits [T, num_experts], as the module's
    docstring says; the ids in no particular order (their weights beside them)."""
    softmax = route.scoring == "softmax"
    scores = logits.float().softmax(dim=-1) if softmax else logits.float().sigmoid()
    for_choice = scores if correction_bias is None else scores + correction_bias.float()
    if route.num_groups > 1:
        tokens = for_choice.shape[0]
        grouped = for_choice.view(tokens, route.num_groups, -1)
        worth = grouped.amax(dim=-1) if softmax else grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        kept = worth.topk(route.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, kept, True)
        for_choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)
    ids = for_choice.topk(route.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if route.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route.scaling_factor, ids


class GroupedTopKRouter(nn.Module):
    """The router of a grouped top-k mixture of experts: `weight` [E, H] and `e_score_correction_bias` [E], both
    float32 whatever the model's dtype (transformers keeps them so), whole on every rank; the logits are computed in
    float32. Checkpoint names: `gate.weight`, `gate.e_score_correction_bias` (none with `correction_bias` False:
    DeepSeek-V2's softmax routing)."""

    # Whole on every rank: the ranks compare its parameters after loading (weights/consistency.py).
    replicated = True

    def __init__(self, hidden_size: int, route: GroupedTopK, correction_bias: bool = True) -> None:
        super().__init__()
        self.route = route
        self.weight = empty_parameter(route.num_experts, hidden_size, dtype=torch.float32)
        self.weight.weight_loader = load_whole
        self.e_score_correction_bias = None
        if correction_bias:
            self.e_score_correction_bias = empty_parameter(route.num_experts, dtype=torch.float32)
            self.e_score_correction_bias.weight_loader = load_whole

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k] int64) for the normed hidden states h [T, H]: on CUDA
        in one launch where device_grouped_router says so."""
        logits = router_logits(h, self.weight)
        bias = self.e_score_correction_bias
        if logits.is_cuda and device_grouped_router(logits.device, self.route, bias is not None):
            from shardserve.kernels.triton.grouped_router import grouped_route

            # The experts' kernels come next: placed at the choice's start (kernels/triton/pdl.py's early launches).
            return grouped_route(logits, bias, self.route, next_early=True)
        return grouped_top_k(logits, bias, self.route)


def router_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [T, H] (the model's dtype) times the float32 router weight [E, H]^T in float32: [T, E]. A single CUDA token
    takes the batch-1 GEMV kernel (kernels/triton/gemv.py: products and sums in float32, as F.linear's of h.float()
    up to their order) in one launch where it matched float64 on this shape; otherwise the cast and torch's float32
    product (three launches at batch 1 on an H200: the cast, cuBLAS's dot and its reduction, about 6 us)."""
    if h.is_cuda and h.shape[0] == 1 and device_router_gemv(weight):
        from shardserve.kernels.triton.gemv import gemv_float32_out

        return gemv_float32_out(h, weight, ROUTER_GEMV_BLOCK_N, preload=ROUTER_GEMV_PRELOAD)
    return F.linear(h.float(), weight)


# Rows of the router's weight a GEMV program takes: its E rows of float32 are few (64 to 512), so one a program
# spreads them over as many SMs.
ROUTER_GEMV_BLOCK_N = 1
# Weight tiles a router's GEMV program loads before its dependent-launch wait: all of its row (a few KB of float32 a
# program, every program placed at once), so after the wait only h is read. Nemotron-3-Nano on an H200, graph replay
# of a batch-1 step with one tile: NVFP4 1.340 -> 1.323 ms, bf16 2.390 -> 2.371 (its 23 routers, 128 x 2688).
ROUTER_GEMV_PRELOAD = 64
_gemv_checked: dict[tuple, bool] = {}


def device_router_gemv(weight: torch.Tensor) -> bool:
    """Whether the batch-1 GEMV computes this router's logits within rtol 1e-5 of float64 on random bf16 and float32
    inputs (the weights too: the real ones may not be loaded yet), once per device and shape; not inside a CUDA
    graph capture (the answer is no until the check has run) nor with SHARDSERVE_DEVICE_EXPERTS=0."""
    key = (weight.device, tuple(weight.shape))
    if key not in _gemv_checked:
        if not envs.DEVICE_EXPERTS.get() or torch.cuda.is_current_stream_capturing():
            return False
        _gemv_checked[key] = _router_gemv_matches(weight)
    return _gemv_checked[key]


def _router_gemv_matches(weight: torch.Tensor) -> bool:
    what = f"the batch-1 GEMV for a router of shape {tuple(weight.shape)} on {weight.device}"
    try:
        from shardserve.kernels.triton.gemv import gemv_float32_out

        g = torch.Generator(device=weight.device).manual_seed(0)
        w = torch.randn(weight.shape, generator=g, device=weight.device)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(1, weight.shape[1], generator=g, device=weight.device).to(dtype)
            got = gemv_float32_out(x, w, ROUTER_GEMV_BLOCK_N, preload=ROUTER_GEMV_PRELOAD)
            want = x.double() @ w.double().T
            if got.dtype != torch.float32 or not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4):
                logger.error("%s differs from float64: torch's float32 product kept", what)
                return False
    except Exception as exc:
        logger.info("%s does not run here: %s: %s", what, type(exc).__name__, exc)
        return False
    return True


_kernel_checked: dict[tuple, bool] = {}


def device_grouped_router(device: torch.device, route: GroupedTopK, has_bias: bool) -> bool:
    """Whether the grouped router's kernel (kernels/triton/grouped_router.py) chose the same experts as grouped_top_k
    (in any order), with weights within rtol 1e-5, on random float32 logits of 1, 37 and 300 tokens (and a random
    bias where the router has one) on this device: once per device, route and bias, never with
    SHARDSERVE_DEVICE_EXPERTS=0. First asked inside a CUDA graph capture (where the check cannot run), the answer
    is no and the check waits for the next call."""
    key = (device, route, has_bias)
    if key not in _kernel_checked:
        if not envs.DEVICE_EXPERTS.get():
            return False
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False  # that graph keeps torch's launches
        _kernel_checked[key] = _kernel_matches(*key)
    return _kernel_checked[key]


def _kernel_matches(device: torch.device, route: GroupedTopK, has_bias: bool) -> bool:
    what = (f"the grouped router's kernel for {route.num_experts} experts ({route.scoring}, top {route.top_k}, "
            f"{route.topk_groups} of {route.num_groups} groups{', a bias' if has_bias else ''}) on {device}")
    try:
        from shardserve.kernels.triton.grouped_router import grouped_route

        g = torch.Generator(device=device).manual_seed(0)
        # float32 logits and bias: no ties, so one right set of experts (whose order does not matter).
        bias = torch.randn(route.num_experts, generator=g, device=device).mul_(0.1) if has_bias else None
        for tokens in (1, 37, 300):
            logits = torch.randn(tokens, route.num_experts, generator=g, device=device)
            weights, ids = by_expert(*grouped_route(logits, bias, route))
            want_weights, want_ids = by_expert(*grouped_top_k(logits, bias, route))
            if not (torch.equal(ids, want_ids) and torch.allclose(weights, want_weights, rtol=1e-5, atol=1e-6)):
                logger.error("%s differs from torch's grouped_top_k: not used", what)
                return False
    except Exception as exc:  # no Triton, or the kernel does not build here
        logger.info("%s does not run here: %s: %s", what, type(exc).__name__, exc)
        return False
    logger.info("%s: one launch", what)
    return True
