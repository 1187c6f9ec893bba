"""A sparse mixture-of-experts block (Qwen3-MoE, Mixtral): a router picks k of E experts per token, each a
SwiGLU FFN, whose outputs are summed with the router's weights.

Tensor parallelism: every expert's FFN is split by intermediate features across ranks like the dense MLP (rank r
holds rows [r0, r1) of each expert's gate and up projections and the same columns of its down projection), so
each rank's output is a partial sum, all-reduced once per layer (deferred into the next norm, as the dense
MLP's). The router is replicated: every rank routes the same tokens to the same experts. When the experts'
intermediate size does not split evenly, the experts are replicated whole (logged), never split wrongly.

Experts' weights live in two tensors per layer: `w13` [E, 2 * I_rank, H] (gate rows, then up rows) and `w2`
[E, H, I_rank]. Checkpoints hold them per expert (`experts.{e}.gate_proj`, Mixtral's `w1`/`w3`/`w2`) or fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); the loaders below take either.

On CUDA the block runs without any host synchronisation, so CUDA graphs capture decode: the norm inside the
router's GEMV (single tokens), the router's softmax and top k in one kernel (kernels/triton/moe_router.py), or for
a single token in the router's GEMV launch (kernels/triton/router_gemv.py; SHARDSERVE_MOE_ROUTE=separate keeps a
launch of its own) or in the experts' alignment launch, the experts in the fused Triton kernel
(kernels/triton/fused_moe.py) for decode and small batches and through torch's grouped GEMM (tokens sorted by
expert on the device, one group per expert) for large ones. Each is compared once per device and shape with a
reference before it is used (the experts with float64 at every kernel config a layer can take); a mismatch is
logged and falls back (to the other, or to the grouped version below, which reads the expert counts on the host:
decode then runs without CUDA graphs). Elsewhere the computation groups the (token, expert) pairs by expert and
runs each expert that received tokens on its tokens at once: a loop over experts, never over tokens.

A quantized checkpoint's experts may stay packed (FP8 or 4-bit with their scales): layers/moe_packed.py holds them,
loads them and picks their product (the fused kernel on the packed bytes where it matched float64, else the
host-grouped version dequantizing the chosen experts per call).

A shared expert (Qwen2-MoE) is a SwiGLU FFN every token takes beside the routed ones, on the same normed input,
scaled by sigmoid(shared_expert_gate(h)) and added before the layer's one all-reduce: split by features like the
experts, or whole on every rank and added on one rank only where its size does not split. DeepSeek's shared
experts are the same FFN without the gate (n_shared_experts * moe_intermediate_size features); its grouped
top-k routing would be a new `route`.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import NORMED, Communicator, reduced_first
from shardserve import envs
from shardserve.kernels.fused_moe_table import ROUTE_ALIGN_MAX_TOKENS
from shardserve.layers.linear import (ColumnParallelLinear, as_tensor, empty_parameter, materialized,
                                     weights_device)
from shardserve.layers.mlp import SwiGLUMLP
from shardserve.layers.sharding import expert_shard, split_rows
from shardserve.weight_format import shape_of

logger = logging.getLogger(__name__)

FUSED_MOE_ENV = envs.DEVICE_EXPERTS.name  # "0": the host-grouped version on GPUs too (no CUDA graphs)
ROUTE_ENV = envs.MOE_ROUTE.name
SHARED = "shared"  # the expert number of a shared expert folded into the block's experts (layers/moe_shared.py)


def route_in_router_gemv() -> bool:
    """Whether a single token's router choice runs in the router's GEMV launch (SHARDSERVE_MOE_ROUTE=gemv) rather
    than in a launch of its own (separate, the default: on two H100s the Qwen3-30B-A3B-shaped batch-1 step took
    2.915 ms with the choice in the GEMV's last program, whose reductions cross its 8 warps, against 2.819)."""
    return envs.MOE_ROUTE.get() == "gemv"


class SparseMoE(nn.Module):
    up_name, activation = "w13", "swiglu"  # its experts' [gate | up] weight (layers/moe_packed.py)

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, comm: Communicator, dtype: torch.dtype, expert_parallel: bool = False,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        shard = expert_shard(num_experts, intermediate_size, comm.rank, comm.world_size, expert_parallel)
        self.experts_held = shard.experts  # [e0, e1): the experts this rank computes
        (r0, r1), sharded = shard.rows, shard.sharded
        self.rows = (r0, r1)
        self.intermediate_size = intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        rows, held = r1 - r0, self.experts_held[1] - self.experts_held[0]
        # The router: whole on every rank, a linear layer so that single-token steps get the GEMV kernels.
        self.gate = ColumnParallelLinear(hidden_size, {None: (0, num_experts)}, False, dtype)
        self.gate.replicated = self.gate.loads_whole_rows = True
        # Under deferred_weights() the experts wait on the meta device until they are packed or materialized.
        device = weights_device()
        self.hidden_size = hidden_size
        self.w13 = empty_parameter(held, 2 * rows, hidden_size, dtype=dtype, device=device)
        self.w13.weight_loader = self._load_w13
        self.w2 = empty_parameter(held, hidden_size, rows, dtype=dtype, device=device)
        self.w2.weight_loader = self._load_w2
        self.packed = None  # a quantized checkpoint's experts kept packed (layers/moe_packed.ExpertPacking)
        self.replicated = not sharded
        self.pending = comm if sharded else None  # the output is a partial sum to all-reduce (in the next norm)
        self.shared_expert = self.shared_expert_gate = None
        # The shared expert held as expert E of w13/w2 and its gate as the router's row E (layers/moe_shared.py):
        # every token then takes k + 1 choices, the last expert E with weight sigmoid(gate).
        self.shared_folded = False
        if shared_intermediate_size:
            self._add_shared_expert(hidden_size, shared_intermediate_size, comm, dtype)

    def _add_shared_expert(self, hidden_size: int, size: int, comm: Communicator, dtype: torch.dtype) -> None:
        """Qwen2-MoE's shared expert and its one-output gate (replicated). The expert is split by features where
        the block's output is all-reduced anyway and its size splits; otherwise it is whole on every rank, and
        while the block's output is a partial sum only rank 0 adds it (once in the all-reduced sum)."""
        if self.pending is not None:
            rows, split = split_rows(size, comm.rank, comm.world_size, "shared expert")
        else:
            rows, split = (0, size), False
        self.shared_expert = SwiGLUMLP(hidden_size, rows, False, dtype, None, not split)  # no reduction of its own
        self.shared_expert_gate = ColumnParallelLinear(hidden_size, {None: (0, 1)}, False, dtype)
        self.shared_expert_gate.replicated = True
        self.adds_shared_expert = split or self.pending is None or comm.rank == 0
        # Whether every rank adds its share of the same features as its experts' (the shared expert could then be
        # one more expert of the block: moe_shared.fold_shared_expert).
        self.shared_like_experts = rows == self.rows and (split or self.pending is None)

    @property
    def choices(self) -> int:
        """Experts each token takes: top k, and the shared expert where it is folded into the experts."""
        return self.top_k + self.shared_folded

    def materialize(self, device) -> None:
        """Give experts built under deferred_weights() their real (empty) weights on `device`."""
        self.w13, self.w2 = materialized(self.w13, device), materialized(self.w2, device)

    # -- loading: shard_id is (expert, 0 gate / 1 up) for w13, (expert, None) for w2, or "all" (fused tensors);
    # expert SHARED is the folded shared expert (layers/moe_shared.py), held in the last slot.
    def slot(self, expert: int | str) -> int | None:
        """Where checkpoint expert `expert` (or SHARED) lives in w13/w2, or None where another rank holds it."""
        e0, e1 = self.experts_held
        if expert == SHARED:
            return e1 - e0 if self.shared_folded else None
        return expert - e0 if e0 <= expert < e1 else None

    def _load_w13(self, param: nn.Parameter, loaded: Any, shard_id: Hashable) -> None:
        if self.packed is not None:
            return self.packed.load(self, "w13", loaded, shard_id)
        (r0, r1), i, rows = self.rows, self.intermediate_size, self.rows[1] - self.rows[0]
        e0, e1 = self.experts_held
        if shard_id == "all":
            _check_shape(loaded, (self.num_experts, 2 * i, param.shape[2]), "experts.gate_up_proj")
            param.data[:e1 - e0, :rows].copy_(as_tensor(loaded[e0:e1, r0:r1]))
            param.data[:e1 - e0, rows:].copy_(as_tensor(loaded[e0:e1, i + r0:i + r1]))
            return
        expert, half = shard_id
        _check_shape(loaded, (i, param.shape[2]), f"expert {expert}'s gate/up projection")
        if (slot := self.slot(expert)) is not None:  # another rank's expert under expert parallelism: not read
            param.data[slot, half * rows:(half + 1) * rows].copy_(as_tensor(loaded[r0:r1]))

    def _load_w2(self, param: nn.Parameter, loaded: Any, shard_id: Hashable) -> None:
        if self.packed is not None:
            return self.packed.load(self, "w2", loaded, shard_id)
        r0, r1 = self.rows
        e0, e1 = self.experts_held
        if shard_id == "all":
            _check_shape(loaded, (self.num_experts, param.shape[1], self.intermediate_size), "experts.down_proj")
            param.data[:e1 - e0].copy_(as_tensor(loaded[e0:e1, :, r0:r1]))
            return
        expert, _ = shard_id
        _check_shape(loaded, (param.shape[1], self.intermediate_size), f"expert {expert}'s down projection")
        if (slot := self.slot(expert)) is not None:
            param.data[slot].copy_(as_tensor(loaded[:, r0:r1]))

    # -- computation
    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                reduce: Communicator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on norm(x + residual); returns its output (a partial sum where `pending` is set) and the new
        residual. `reduce`: x is a partial sum still to be all-reduced (the previous block deferred it). The
        norm runs inside the router's GEMV where that kernel was chosen (single tokens on GPUs), and so may the
        router's choice (routes_in_router)."""
        chosen = None
        if self.routes_in_router(x):
            x, residual, reduce = reduced_first(x, residual, norm, reduce)
            chosen = self._choice_in_router(x, residual, norm, reduce)
        if chosen is not None:
            from shardserve.kernels.triton.fused_moe import one_token_experts

            h, residual, weights, ids = chosen
            if self.packed is not None:
                out = self.experts(h, weights, ids)
            else:
                out = one_token_experts(h, self.w13, self.w2, weights, ids, self.experts_held[0])
        else:
            logits, h, residual = self.gate.forward_normed(x, residual, norm, reduce, keep_normed=True)
            out = self.routed_experts(h, logits)
        if self.shared_expert is not None and self.adds_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return out, residual

    def routes_in_router(self, x: torch.Tensor) -> bool:
        """Whether a single token's choice may come from the router's GEMV launch: on CUDA, with the router's weight
        plain for the kernel's fused forms, the fused router past its check, SHARDSERVE_MOE_ROUTE=gemv, and the
        experts on a one-token device path that takes a choice made elsewhere (_one_token_experts_on_device). A
        folded shared expert's gate is the router's last row (route_token's SHARED). The launch itself still needs
        a Triton form chosen for the router's shape (_choice_in_router)."""
        return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and self.gate.fusable and self.gate.bias is None
                and route_in_router_gemv() and device_router(x.device, self.num_experts, self.top_k, self.renormalize)
                and self._one_token_experts_on_device())

    def _one_token_experts_on_device(self) -> bool:
        """Whether a single token's experts run on the device from a choice already made: packed experts on the
        fused kernel's one-token tiles, 16-bit ones on the one-token path of the fused kernel (past its check)."""
        from shardserve.kernels.fused_moe_table import one_token_packed_tiles, one_token_tiles

        if self.packed is not None:
            return one_token_packed_tiles() is not None and self.packed.graph_safe(self)
        return one_token_tiles() is not None and device_experts(self.w13, self.w2, self.choices) in (
            fused_experts, fused_then_grouped_mm)

    def _choice_in_router(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                          reduce) -> tuple[torch.Tensor, ...] | None:
        """(h, new residual, weights [1, k] float32, ids [1, k] int64) from one launch of the router's GEMV that
        also routes (kernels/triton/router_gemv.py), with the configuration chosen for the router's shape: the
        norm-fused form on x + residual, or the plain one where x is already normed (`reduce` NORMED). None where
        the router's kernel has no such form, it failed its start-up check (device_router_gemv), or the device's
        arrival counts are not to be had; the caller then runs forward_normed and the separate choice, exactly
        today's launches. `reduce`: None or NORMED (reduced_first)."""
        from shardserve.kernels.triton.router_gemv import gemv_rmsnorm_route, gemv_route

        weight, normed = self.gate.weight, reduce is NORMED
        config = router_gemv_config(self.gate.kernel, x, weight, fused_norm=not normed)
        shared = self.shared_folded
        if config is None or not device_router_gemv(weight, config, not normed, self.top_k, self.renormalize, shared):
            return None
        if normed:
            out = gemv_route(x, weight, self.top_k, self.renormalize, *config, shared=shared)
            return None if out is None else (x, residual, out[1], out[2])
        out = gemv_rmsnorm_route(x, residual, norm.weight, norm.eps, weight, self.top_k, self.renormalize, *config,
                                 shared=shared)
        return None if out is None else (out[2], out[1], out[3], out[4])

    def routed_experts(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The experts' sum for the router's logits [T, E]: on CUDA for a single token the choice and the experts'
        alignment in one launch (fused_moe_from_logits) where that matched the reference on this device."""
        if h.is_cuda and self.packed is None and not self.shared_folded and 0 < h.shape[0] <= ROUTE_ALIGN_MAX_TOKENS \
                and device_routed_experts(
                self.w13, self.w2, logits.shape[1], self.top_k, self.renormalize):
            from shardserve.kernels.triton.fused_moe import fused_moe_from_logits

            return fused_moe_from_logits(h, logits, self.w13, self.w2, self.top_k, self.renormalize,
                                         self.experts_held[0])
        weights, experts = self.route(logits)
        return self.experts(h, weights, experts)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token [T, k] and their weights [T, k] (float32): softmax over all experts'
        logits, the k best, renormalized to sum to 1 where the model says so (Mixtral always, Qwen3-MoE with
        norm_topk_prob). On CUDA in one fused kernel where it matched this version on this device. With the shared
        expert folded, logits [T, E + 1] and a last choice [T, k + 1] of expert E (route_with_shared)."""
        if logits.is_cuda and device_router(logits.device, self.num_experts, self.top_k, self.renormalize):
            from shardserve.kernels.triton.moe_router import route_top_k

            # The experts' kernels come next: placed at the choice's start (kernels/triton/pdl.py's early launches).
            return route_top_k(logits, self.top_k, self.renormalize, self.shared_folded, next_early=True)
        if self.shared_folded:
            return route_with_shared(logits, self.top_k, self.renormalize)
        return route_reference(logits, self.top_k, self.renormalize)

    graph_unsafe_reason = "a mixture of experts without its fused kernel reads expert counts on the host"

    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph can capture this block: a device-only expert computation runs here (no host
        synchronisation)."""
        if self.packed is not None:
            return self.packed.graph_safe(self)
        return self.w13.is_cuda and device_experts(self.w13, self.w2, self.choices) is not None

    def experts(self, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * FFN_{experts[t, j]}(h[t]) over this rank's experts and features (every path
        leaves out choices of experts outside [0, held): other ranks' under expert parallelism)."""
        if self.experts_held[0]:
            experts = experts - self.experts_held[0]
        if self.packed is not None:
            return self.packed.experts(self, h, weights, experts)
        compute = device_experts(self.w13, self.w2, self.choices) if h.is_cuda else None
        return (compute or grouped_experts)(h, self.w13, self.w2, weights, experts)


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_with_shared(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_reference on the experts' logits [T, :E], then each token's shared expert (E) as its last choice, with
    weight sigmoid of the last logit (its gate): [T, k + 1]."""
    weights, experts = route_reference(logits[:, :-1], top_k, renormalize)
    gate = torch.sigmoid(logits[:, -1:].float())
    return torch.cat([weights, gate], dim=1), torch.cat([experts, torch.full_like(experts[:, :1],
                                                                                   logits.shape[1] - 1)], dim=1)


def router_gemv_config(kernel, x: torch.Tensor, weight: torch.Tensor, fused_norm: bool):
    """The batch-1 GEMV configuration (block_n, block_k, num_warps, num_stages) that start-up chose for the router's
    shape, norm-fused or plain (layers/cuda_gemv.Batch1GemvKernel), or None: another kernel, or no Triton form."""
    configs = getattr(kernel, "normed_configs" if fused_norm else "configs", None)
    if configs is None:
        return None
    from shardserve.layers.cuda_gemv import _one_row_config

    return _one_row_config(configs, x, weight)


_router_gemv_checked: dict[tuple, bool] = {}


def device_router_gemv(weight: torch.Tensor, config: tuple[int, int, int, int], fused_norm: bool, top_k: int,
                       renormalize: bool, shared: bool = False) -> bool:
    """Whether the router's GEMV that also routes (kernels/triton/router_gemv.py) gave, on random inputs of the
    router's shape with this configuration, the same bits as the two launches it replaces: the GEMV (norm-fused
    with the normed row kept, with and without a residual, or plain) and route_top_k on its logits; twice in a row,
    so that its arrival count went back to 0. Once per device, shape, dtype, configuration and router; a mismatch
    is logged and the two launches stay. Where the form cannot run yet (no arrival counts: first asked inside a
    CUDA graph capture) the answer is no, and the check waits for the next call."""
    key = (weight.device, tuple(weight.shape), weight.dtype, tuple(config), fused_norm, top_k, renormalize, shared)
    if key not in _router_gemv_checked:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # the check cannot run inside a capture: that graph keeps the two launches
        matches = _router_gemv_matches(weight, config, fused_norm, top_k, renormalize, shared)
        if matches is None:
            return False
        _router_gemv_checked[key] = matches
    return _router_gemv_checked[key]


def _router_gemv_matches(weight: torch.Tensor, config, fused_norm: bool, top_k: int, renormalize: bool,
                         shared: bool = False) -> bool | None:
    """device_router_gemv's check: None where the form returned no result (no arrival counts)."""
    from shardserve.kernels.triton.gemv import gemv, gemv_rmsnorm
    from shardserve.kernels.triton.moe_router import route_top_k
    from shardserve.kernels.triton.router_gemv import gemv_rmsnorm_route, gemv_route

    num_experts, hidden = weight.shape
    what = (f"the {num_experts}x{hidden} router's GEMV with its choice ({'norm-fused' if fused_norm else 'plain'}, "
            f"{tuple(config)}, top {top_k}{', a shared expert' if shared else ''}) on {weight.device}")
    g = torch.Generator(device=weight.device).manual_seed(0)
    w = torch.randn(weight.shape, generator=g, device=weight.device).mul_(0.05).to(weight.dtype)
    x = torch.randn(1, hidden, generator=g, device=weight.device).to(weight.dtype)
    residual = torch.randn(1, hidden, generator=g, device=weight.device).to(weight.dtype)
    norm_weight = torch.rand(hidden, generator=g, device=weight.device).add_(0.5).to(weight.dtype)
    if fused_norm:
        cases = [(lambda r=r: gemv_rmsnorm_route(x, r, norm_weight, 1e-6, w, top_k, renormalize, *config,
                                                 shared=shared),
                  lambda r=r: gemv_rmsnorm(x, r, norm_weight, 1e-6, w, *config, keep_normed=True))
                 for r in (residual, None)]
    else:
        cases = [(lambda: gemv_route(x, w, top_k, renormalize, *config, shared=shared),
                  lambda: (gemv(x, w, *config),))]
    try:
        for run, separate in cases:
            want = separate()
            want = (*want, *route_top_k(want[0], top_k, renormalize, shared))
            for _ in range(2):
                got = run()
                if got is None:
                    return None
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    logger.error("%s differs from its two launches: not used", what)
                    return False
    except Exception as exc:  # no Triton, or the kernel does not build here
        logger.info("%s does not run here: %s: %s", what, type(exc).__name__, exc)
        return False
    logger.info("%s: one launch", what)
    return True


_router_checked: dict[tuple, bool] = {}


def device_router(device: torch.device, num_experts: int, top_k: int, renormalize: bool) -> bool:
    """Whether the fused router kernel chose the same experts as route_reference (in any order), with weights
    within 1e-5, on random logits of 1, 37 and 300 tokens on this device (once per device and router shape)."""
    key = (device, num_experts, top_k, renormalize)
    if key not in _router_checked:
        _router_checked[key] = envs.DEVICE_EXPERTS.get() and _router_matches(*key)
    return _router_checked[key]


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing's (weights, ids) [T, k] with each row's choices in expert order: how two routings' choices compare."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids


def _router_matches(device, num_experts: int, top_k: int, renormalize: bool) -> bool:
    try:
        from shardserve.kernels.triton.moe_router import route_top_k

        g = torch.Generator(device=device).manual_seed(0)
        for tokens in (1, 37, 300):
            # float32 logits: no ties, so one right set of experts (whose order does not matter).
            logits = torch.randn(tokens, num_experts, generator=g, device=device)
            for shared in (False, True):  # the second: with a folded shared expert's gate as logit E
                wide = torch.cat([logits, torch.randn(tokens, 1, generator=g, device=device)], 1) if shared else logits
                weights, ids = by_expert(*route_top_k(wide, top_k, renormalize, shared))
                want = route_with_shared(wide, top_k, renormalize) if shared else route_reference(wide, top_k,
                                                                                                  renormalize)
                want_weights, want_ids = by_expert(*want)
                if not (torch.equal(ids, want_ids) and torch.allclose(weights, want_weights, rtol=1e-5, atol=1e-6)):
                    logger.error("the fused router differs from torch's for %d experts, top %d%s on %s: not used",
                                 num_experts, top_k, " and a shared expert" if shared else "", device)
                    return False
    except Exception as exc:  # no Triton, or the kernel does not build here
        logger.info("the fused router does not run here: %s: %s", type(exc).__name__, exc)
        return False
    return True


def grouped_experts(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
    """The experts grouped by expert in plain torch (any device; reads the expert counts on the host). Choices of
    experts outside [0, len(w13)) (another rank's, under expert parallelism) are left out."""
    return grouped_by_expert(h, w13.shape[0], lambda e: (w13[e], w2[e]), weights, experts)


def swiglu_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert on its tokens: w2 (silu(gate) * up) with [gate | up] = w13 x (w13 [2I, H], w2 [H, I])."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def relu2_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One non-gated expert on its tokens with the squared ReLU: w2 relu(w1 x)^2 (w1 [I, H], w2 [H, I])."""
    return F.linear(torch.relu(F.linear(x, w1)).square(), w2)


def silu_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)), w2)


# An expert's product by its activation: SwiGLU's gate and up rows, or a non-gated expert's up rows.
EXPERT_FFNS = {"swiglu": swiglu_ffn, "relu2": relu2_ffn, "silu": silu_ffn}


def grouped_by_expert(h: torch.Tensor, num_experts: int, expert_weights, weights: torch.Tensor,
                      experts: torch.Tensor, ffn=swiglu_ffn) -> torch.Tensor:
    """grouped_experts with expert e's weights from expert_weights(e) (by default SwiGLU's (w13 [2I, H], w2 [H, I])),
    asked only for experts that received tokens (packed experts dequantize there), each run on all its tokens at
    once as ffn(x, *expert_weights(e)). Choices outside [0, num_experts) add nothing."""
    tokens, k = experts.shape
    flat = experts.flatten()
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # the others in one last group
    order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, in token order within each
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    scale = weights.flatten().index_select(0, order).to(h.dtype).unsqueeze(1)
    token_of = order // k
    out = torch.zeros_like(h)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picked = token_of[start:start + count]
        y = ffn(h.index_select(0, picked), *expert_weights(expert)) * scale[start:start + count]
        out.index_add_(0, picked, y)
        start += count
    return out


def grouped_mm_experts(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       experts: torch.Tensor) -> torch.Tensor:
    """The experts through torch's grouped GEMM (CUDA, 16-bit): pairs sorted by expert on the device, each
    expert's rows one group; no host synchronisation, so CUDA graphs capture it. Choices outside [0, len(w13))
    sort last, outside every group, and count 0."""
    tokens, k = experts.shape
    num_experts = w13.shape[0]
    flat = experts.flatten()
    held = (flat >= 0) & (flat < num_experts)
    ids, order = torch.sort(torch.where(held, flat, num_experts))
    # histc takes integers on CUDA only (floats here: exact below 2^24); the tail falls outside [0, E - 1].
    counts = torch.histc(ids.int() if ids.is_cuda else ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    x = h.index_select(0, order // k)
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)
    scale = torch.where(held, weights.flatten(), 0).index_select(0, order).to(y.dtype).unsqueeze(1)
    y = torch.where(scale != 0, y * scale, 0)  # rows past the groups are never written: drop them, NaN or not
    unsorted = torch.empty_like(y).index_copy_(0, order, y)
    return unsorted.view(tokens, k, -1).sum(dim=1)


def fused_experts(h, w13, w2, weights, experts):
    from shardserve.kernels.triton.fused_moe import fused_moe

    return fused_moe(h, w13, w2, weights, experts)


_device_checked: dict[tuple, object] = {}


def device_experts(w13: torch.Tensor, w2: torch.Tensor, top_k: int):
    """The device-only expert computation for these experts' shapes on this GPU, or None (then grouped_experts,
    without CUDA graphs): the fused Triton kernel, else torch's grouped GEMM, whichever first matches the
    float64 reference on random inputs at every token count that picks another kernel config, with the layer's
    top k (checked once per device, shapes, top k and dtype; a mismatch is logged)."""
    if not w13.is_cuda or not envs.DEVICE_EXPERTS.get():
        return None
    key = (w13.device, tuple(w13.shape), tuple(w2.shape), w13.dtype, top_k)
    if key not in _device_checked:
        fused = _matches(fused_experts, w13, w2, top_k)
        # torch's grouped GEMM has a device kernel for 16-bit weights only; in float32 it loops on the host.
        grouped = w13.dtype in (torch.bfloat16, torch.float16) and _matches(grouped_mm_experts, w13, w2, top_k)
        if fused and grouped:
            _device_checked[key] = fused_then_grouped_mm
        else:
            _device_checked[key] = fused_experts if fused else grouped_mm_experts if grouped else None
        if _device_checked[key] is None:
            logger.warning("experts of shape %s on %s run grouped by expert with the counts read on the host: "
                           "no CUDA graphs", tuple(w13.shape), w13.device)
    return _device_checked[key]


def fused_then_grouped_mm(h, w13, w2, weights, experts):
    """The fused kernel while it reads each chosen expert's weights about once (decode, small batches), torch's
    grouped GEMM past that (prefill), where it computes faster (docs/benchmarks-notebook.md, "MoE kernels")."""
    from shardserve.kernels.fused_moe_table import FUSED_MAX_ROWS_PER_EXPERT

    if experts.numel() > FUSED_MAX_ROWS_PER_EXPERT * w13.shape[0]:
        return grouped_mm_experts(h, w13, w2, weights, experts)
    return fused_experts(h, w13, w2, weights, experts)


_routed_checked: dict[tuple, bool] = {}


def device_routed_experts(w13: torch.Tensor, w2: torch.Tensor, num_logits: int, top_k: int,
                          renormalize: bool) -> bool:
    """Whether fused_moe_from_logits may run these experts for a few tokens: the fused router and the fused
    experts passed their own checks, and the one-launch choice and alignment gave the reference's output at every
    token count it takes, for experts [0, E) and for the last E of num_logits (another rank's first)."""
    if not (device_router(w13.device, num_logits, top_k, renormalize)
            and device_experts(w13, w2, top_k) in (fused_experts, fused_then_grouped_mm)):
        return False
    key = (w13.device, tuple(w13.shape), tuple(w2.shape), w13.dtype, num_logits, top_k, renormalize)
    if key not in _routed_checked:
        _routed_checked[key] = _routed_matches(w13, w2, num_logits, top_k, renormalize)
    return _routed_checked[key]


def _routed_matches(w13: torch.Tensor, w2: torch.Tensor, num_logits: int, top_k: int, renormalize: bool) -> bool:
    from shardserve.kernels.fused_moe_table import ROUTE_ALIGN_MAX_TOKENS
    from shardserve.kernels.triton.fused_moe import fused_moe_from_logits

    g = torch.Generator(device=w13.device).manual_seed(0)
    a, b = _random_experts(w13, w2, g)
    bases = sorted({0, num_logits - w13.shape[0]})
    what = f"experts of shape {tuple(w13.shape)} on {w13.device}"
    for tokens in range(1, ROUTE_ALIGN_MAX_TOKENS + 1):
        x = torch.randn(tokens, w13.shape[2], generator=g, device=w13.device).to(w13.dtype)
        logits = torch.randn(tokens, num_logits, generator=g, device=w13.device)  # float32: no ties
        weights, ids = route_reference(logits, top_k, renormalize)
        for base in bases:
            if not close_to_float64("fused_moe_from_logits", what, tokens, w13.dtype,
                                    lambda: fused_moe_from_logits(x, logits, a, b, top_k, renormalize, base),
                                    lambda: reference_experts(x, a, b, weights, ids - base)):
                return False
    return True


def close_to_float64(name: str, what: str, tokens: int, dtype: torch.dtype, run, reference) -> bool:
    """Whether run() is within dtype's tolerance (relative) of the float64 reference(); a run that raises (no
    Triton, out of shared memory...) or misses is logged, naming `name`, `what` it computed and at how many tokens."""
    from shardserve.kernels.self_check import TOLERANCE

    try:
        got = run().double()
    except Exception as exc:  # a kernel that cannot run here: not used
        logger.info("%s does not run %s here at %d tokens: %s: %s", name, what, tokens, type(exc).__name__, exc)
        return False
    want = reference()
    error = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not error < TOLERANCE[dtype]:
        logger.error("%s is off by %.3g (relative) for %s at %d tokens: not used", name, error, what, tokens)
        return False
    return True


def check_routes(num_experts: int, hidden: int, top_k: int, dtype: torch.dtype, device, g: torch.Generator):
    """(tokens, x, weights, ids) of random tokens routed to top_k of num_experts, at every token count a check of
    the experts runs (_check_token_counts)."""
    k = min(top_k, num_experts)
    for tokens in _check_token_counts(k, num_experts):
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(tokens, num_experts, generator=g, device=device)
        yield (tokens, x, *torch.topk(torch.softmax(logits, dim=-1), k, dim=-1))


def _random_experts(w13: torch.Tensor, w2: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights of the layer's shapes and scale (the real ones may not be loaded yet)."""
    a = torch.randn(w13.shape, generator=g, device=w13.device).mul_(0.05).to(w13.dtype)
    b = torch.randn(w2.shape, generator=g, device=w13.device).mul_(0.05).to(w13.dtype)
    return a, b


def _check_token_counts(top_k: int, num_experts: int) -> list[int]:
    """A single token, a small odd batch, and one token count per config of the fused kernel's table."""
    from shardserve.kernels.fused_moe_table import token_counts_per_config

    return sorted({1, 37, *token_counts_per_config(top_k, num_experts)})


def reference_experts(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None, weights: torch.Tensor,
                      experts: torch.Tensor, packed=None) -> torch.Tensor:
    """float64, one chosen expert at a time (only that expert's weights widened: a layer's experts in float64
    would take 4x their memory). Choices outside [0, len(w13)) (another rank's experts) add nothing. `packed`
    (kernels/packed_experts.PackedExperts) instead of w13 and w2: its experts from the packed definition, with its
    activation."""
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    count = packed.num_experts if packed is not None else w13.shape[0]
    ffn = EXPERT_FFNS[packed.activation if packed is not None else "swiglu"]
    for expert in experts.unique().tolist():
        if not 0 <= expert < count:
            continue
        token, choice = (experts == expert).nonzero(as_tuple=True)
        a, b = packed.reference(expert) if packed is not None else (w13[expert].double(), w2[expert].double())
        out.index_add_(0, token, ffn(x[token], a, b) * weights[token, choice, None].double())
    return out


def _matches(compute, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    g = torch.Generator(device=w13.device).manual_seed(0)
    a, b = _random_experts(w13, w2, g)
    what = f"experts of shape {tuple(w13.shape)} on {w13.device}"
    for tokens, x, weights, ids in check_routes(w13.shape[0], w13.shape[2], top_k, w13.dtype, w13.device, g):
        if not close_to_float64(compute.__name__, what, tokens, w13.dtype, lambda: compute(x, a, b, weights, ids),
                                lambda: reference_experts(x, a, b, weights, ids)):
            return False
    logger.info("%s: %s", what, compute.__name__)
    return True


def _check_shape(loaded: Any, expected: tuple[int, ...], what: str) -> None:
    shape = shape_of(loaded)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint tensor for {what} has shape {shape}, expected {tuple(expected)}")
