"""A quantized mixture of experts' experts kept packed (kernels/packed_experts.py): a byte a weight for FP8, half a
byte for 4-bit, with their scales (and zero points), on GPUs and on CPUs with SHARDSERVE_QUANTIZED_LAYERS=packed.
Both kinds of experts: a SparseMoE's SwiGLU experts and NemotronH's non-gated ones (layers/nongated_experts.py,
whose up weight is `w1`: the w13 below stands for either).

Sharding is the dense rule: each rank reads only the packed bytes and scales of its experts' rows (w13: the
gate's and the up projection's rows [r0, r1), each with its own scales) and columns (w2: [r0, r1)), so its
columns must be whole scale groups. A layer whose slice would split a group, or whose checkpoint is in act order
(g_idx), keeps its experts dequantized in the compute dtype (logged), as dense layers do.

Products: on CUDA the fused kernel reads the packed experts (fused_moe_packed), used only after it matched
float64 on the packed values at every token count that picks another kernel config (once per device, layout,
shapes and top k). Where it failed, or Triton cannot run, or off GPUs, each call groups the pairs by expert on
the host and dequantizes each chosen expert on the fly (no CUDA graphs on GPUs): never wrong numbers.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

import torch
from torch import nn

from shardserve import envs
from shardserve.kernels.packed_experts import PackedExperts
from shardserve.layers.nongated_experts import NonGatedExperts
from shardserve.layers.moe import (EXPERT_FFNS, SparseMoE, _check_shape, check_routes, close_to_float64,
                                   grouped_by_expert, reference_experts)
from shardserve.layers.linear import as_tensor
from shardserve.layers.quantization import format_of
from shardserve.layers.quantization.packed import PackedLayout
from shardserve.layers.quantization.selection import log_kept_dequantized

logger = logging.getLogger(__name__)

_DEQUANTIZED_HINT = "SHARDSERVE_QUANTIZED_LAYERS=dequantized serves this checkpoint with the values it encodes"


def expert_groups(moe: SparseMoE, layout: PackedLayout) -> tuple[tuple[int, int] | None, str]:
    """The scale groups (w13's, w2's) of this rank's packed experts, or None and why they cannot be packed."""
    hidden, (r0, r1) = moe.hidden_size, moe.rows
    if layout.act_order:
        return None, "an act-order (g_idx) checkpoint"
    g13, g2 = layout.group or hidden, layout.group or r1 - r0
    if hidden % g13:
        return None, f"its hidden size {hidden} is not whole groups of {g13}"
    if r0 % g2 or (r1 - r0) % g2:
        return None, f"its expert features [{r0}, {r1}) split groups of {g2}"
    if format_of(layout.kind).per_byte > 1 and (hidden % 2 or (r1 - r0) % 2 or g13 % 2 or g2 % 2):
        return None, "its columns do not pack in pairs"
    return (g13, g2), ""


class ExpertPacking:
    """The packed parameters of one block of experts (set as moe.packed): a SparseMoE's SwiGLU experts (w13, gate
    and up rows) or NonGatedExperts (w1, up rows only; `moe.up_name` names it). The up weight and w2 hold the codes,
    `{name}_scale` their scales [E, N, K / group] (4-bit: scale-and-zero words, kernels/quant_pack.py)."""

    def __init__(self, moe: SparseMoE | NonGatedExperts, layout: PackedLayout, groups: tuple[int, int],
                 device) -> None:
        up = moe.up_name
        experts, up_rows, hidden = getattr(moe, up).shape
        rows = moe.rows[1] - moe.rows[0]
        self.kind, (self.group13, self.group2) = layout.kind, groups
        self.format = format_of(layout.kind)
        self.compute_dtype = moe.w2.dtype
        self.activation = moe.activation
        # Parameters filled by the loader of the weight they belong to.
        fmt = self.format
        rows_too = ("_row_scale",) if fmt.row_scaled else ()
        self.parts_with = {name: tuple(f"{name}{part}" for part in ("_scale", *rows_too)) for name in (up, "w2")}
        up_weight, w2 = fmt.codes(experts, up_rows, hidden, device=device), fmt.codes(experts, hidden, rows,
                                                                                      device=device)
        up_weight.weight_loader, w2.weight_loader = getattr(moe, f"_load_{up}"), moe._load_w2
        setattr(moe, up, up_weight)
        moe.w2 = w2
        setattr(moe, f"{up}_scale", fmt.scales(experts, up_rows, hidden, group=self.group13, device=device))
        moe.w2_scale = fmt.scales(experts, hidden, rows, group=self.group2, device=device)
        setattr(moe, f"{up}_row_scale", fmt.row_scales(experts, up_rows, hidden, device=device))
        moe.w2_row_scale = fmt.row_scales(experts, hidden, rows, device=device)

    def describe(self) -> str:
        return f"{self.kind} experts (groups of {self.group13} and {self.group2})"

    def view(self, moe: SparseMoE | NonGatedExperts) -> PackedExperts:
        up = moe.up_name
        return PackedExperts(self.kind, getattr(moe, up).data, getattr(moe, f"{up}_scale").data, self.group13,
                             moe.w2.data, moe.w2_scale.data, self.group2, self.activation,
                             _data(getattr(moe, f"{up}_row_scale")), _data(moe.w2_row_scale))

    def graph_safe(self, moe: SparseMoE | NonGatedExperts) -> bool:
        """The block's graph_safe for these experts: the fused kernel runs on them (packed_compute)."""
        return moe.w2.is_cuda and packed_compute(self.view(moe), moe.choices, self.compute_dtype) is packed_fused

    def experts(self, moe: SparseMoE | NonGatedExperts, h: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        """The block's experts for these experts (ids already local to this rank), by packed_compute's choice."""
        packed = self.view(moe)
        return packed_compute(packed, moe.choices, h.dtype)(h, packed, weights, ids)

    def load(self, moe: SparseMoE | NonGatedExperts, which: str, loaded: Any, shard_id: Hashable) -> None:
        """One expert's gate, up (which "w13", shard id (expert, 0 or 1); a non-gated expert's "w1", (expert,
        None)) or down projection ("w2") from a quantized checkpoint: only this rank's rows (up) or columns (w2) of
        its packed bytes and scales are read. Float tensors (synthetic weights of a quantized config, per expert or
        all experts in one) are quantized here."""
        if not isinstance(loaded, self.format.stored):
            if hasattr(loaded, "read_packed"):
                raise ValueError(f"packed {self.kind} experts cannot load a {type(loaded).__name__}; "
                                 f"{_DEQUANTIZED_HINT}")
            return self._quantize_floats(moe, which, loaded, shard_id)
        if shard_id == "all":
            raise ValueError(f"packed {self.kind} experts load from the checkpoint's quantized per-expert tensors, "
                             f"not one tensor of all experts; {_DEQUANTIZED_HINT}")
        expert, half = shard_id
        half = half or 0  # a non-gated expert's up rows: the weight's only half
        slot = moe.slot(expert)
        (r0, r1), inter, hidden = moe.rows, moe.intermediate_size, moe.hidden_size
        if which != "w2":
            _check_shape(loaded, (inter, hidden), f"expert {expert}'s gate/up projection")
            source, rows = (r0, r1, 0, hidden), slice(half * (r1 - r0), (half + 1) * (r1 - r0))
        else:
            _check_shape(loaded, (hidden, inter), f"expert {expert}'s down projection")
            source, rows = (0, hidden, r0, r1), slice(None)
        if slot is None:  # another rank's expert under expert parallelism: not read
            return
        target = getattr(moe, which).data[slot, rows]
        scale = getattr(moe, f"{which}_scale").data[slot, rows]
        row_scale = getattr(moe, f"{which}_row_scale")
        row_scale = None if row_scale is None else row_scale.data[slot, rows]
        codes, scales, perm = self.format.read_stored(loaded, *source)
        if perm is not None:
            raise ValueError(f"expert {expert}'s columns are in act order, which packed experts do not take; "
                             f"{_DEQUANTIZED_HINT}")
        target.copy_(codes)
        self.format.copy_scales(scale, row_scale, scales)

    def _quantize_floats(self, moe: SparseMoE | NonGatedExperts, which: str, loaded: Any,
                         shard_id: Hashable) -> None:
        """This rank's rows (up weight) or columns (w2) of float experts, quantized as a packed dense layer
        quantizes its rows (its format's quantize, groups along the input)."""
        (r0, r1), inter = moe.rows, moe.intermediate_size
        (e0, e1), rows = moe.experts_held, r1 - r0
        up = which != "w2"
        if shard_id == "all":
            held = slice(0, e1 - e0)
            halves = [loaded[e0:e1, r0:r1]] + ([loaded[e0:e1, inter + r0:inter + r1]] if which == "w13" else [])
            parts = ([(slice(h * rows, (h + 1) * rows), part) for h, part in enumerate(halves)] if up
                     else [(slice(None), loaded[e0:e1, :, r0:r1])])
        else:
            expert, half = shard_id
            held = moe.slot(expert)
            if held is None:
                return
            half = half or 0
            parts = ([(slice(half * rows, (half + 1) * rows), loaded[r0:r1])] if up
                     else [(slice(None), loaded[:, r0:r1])])
        fmt = self.format
        group = self.group13 if up else self.group2
        row_scales = getattr(moe, f"{which}_row_scale")
        for out_rows, values in parts:
            values = as_tensor(values).float()
            lead = values.shape[:-1]
            codes, scale = fmt.quantize(values.reshape(-1, values.shape[-1]), group)
            getattr(moe, which).data[held, out_rows].copy_(codes.reshape(*lead, -1))
            if fmt.row_scaled:
                scale = (scale[0].reshape(*lead, -1), scale[1].reshape(lead))
            else:
                scale = scale.reshape(*lead, -1)
            fmt.copy_scales(getattr(moe, f"{which}_scale").data[held, out_rows],
                            None if row_scales is None else row_scales.data[held, out_rows], scale)


def _data(param: nn.Parameter | None) -> torch.Tensor | None:
    return None if param is None else param.data


def pack_experts(model: nn.Module, names: set[str] | None, layout: PackedLayout, device, log: bool = True) -> int:
    """Make the expert blocks whose experts the checkpoint quantizes (both w13 and w2 in `names`; None: every
    block, as for synthetic weights of a quantized config) packed before loading; every other block gets its
    dense experts (built under deferred_weights()). Returns how many."""
    count, unpacked = 0, []
    for name, moe in model.named_modules():
        if not isinstance(moe, (SparseMoE, NonGatedExperts)):
            continue
        groups = None
        if names is None or {f"{name}.{moe.up_name}", f"{name}.w2"} <= names:
            groups, why = expert_groups(moe, layout)
            if groups is None:
                unpacked.append(f"{name} ({why})")
        if groups is not None:
            moe.packed = ExpertPacking(moe, layout, groups, device)
            count += 1
        else:
            moe.materialize(device)
    if log:
        log_kept_dequantized("expert blocks keep dequantized experts", unpacked, layout)
    if log and count:
        logger.info("%d expert blocks keep their experts packed (%s)", count, layout.describe())
    return count


# -- the products ----------------------------------------------------------------------------------------------


def four_bit_one_token(h: torch.Tensor, experts: PackedExperts) -> bool:
    """Whether packed_fused takes moe_four_bit's float16 pair sums for h: one token, the one-token path on
    (SHARDSERVE_MOE_ONE_TOKEN), and experts that moe_four_bit.takes_float16_pairs."""
    from shardserve.kernels.fused_moe_table import one_token_packed_tiles
    from shardserve.kernels.triton.moe_four_bit import takes_float16_pairs

    return h.shape[0] == 1 and one_token_packed_tiles() is not None and takes_float16_pairs(experts, h.dtype)


def packed_fused(h, experts: PackedExperts, weights, ids):
    """The fused kernels: one token's 4-bit experts with float16 pair sums where four_bit_one_token
    (one_token_four_bit), else fused_moe_packed (its one-token path or grouped GEMMs)."""
    from shardserve.kernels.triton.fused_moe import fused_moe_packed

    if four_bit_one_token(h, experts):
        return one_token_four_bit(h, experts, weights, ids)
    return fused_moe_packed(h, experts, weights, ids)


def one_token_four_bit(h: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor,
                       shared=None, h_early: bool = False) -> torch.Tensor:
    """One token's 4-bit experts where four_bit_one_token (with `shared`, moe_four_bit.SharedSlots: the shared
    expert's slots too): the CUDA C kernels of kernels/cuda/fp4_products.py where they run and take the experts
    (non-gated fp4 in groups of 16 on a Hopper GPU; SHARDSERVE_CUDA_KERNELS=off: never; a kernel NVRTC cannot compile
    turns them off for the process), else moe_four_bit's Triton kernels. h_early: h was written two or more launches
    before (fp4_experts' x_early)."""
    from shardserve.kernels.cuda import runtime
    from shardserve.kernels.cuda.fp4_products import experts_fit, fp4_experts
    from shardserve.kernels.triton.moe_four_bit import one_token_four_bit_experts

    slots = shared.slots if shared is not None else 0
    if runtime.available(h.device) and experts_fit(experts, h.dtype, ids.shape[1] + slots) is None:
        try:
            return fp4_experts(h, experts, weights, ids, shared, x_early=h_early)
        except runtime.CompileError as e:
            runtime.disable(e)
    return one_token_four_bit_experts(h, experts, weights, ids, shared=shared)


def packed_grouped(h: torch.Tensor, experts: PackedExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Grouped by expert on the host, each chosen expert dequantized to h's dtype for its tokens (any device)."""
    return grouped_by_expert(h, experts.num_experts, lambda e: experts.expert(e, h.dtype), weights, ids,
                             EXPERT_FFNS[experts.activation])


_checked: dict[tuple, bool] = {}


def packed_compute(experts: PackedExperts, top_k: int, dtype: torch.dtype):
    """packed_fused where it matched float64 here (CUDA: checked once per device, layout, shapes, dtype and top k
    on these experts' packed values), else packed_grouped (host-synchronised: no CUDA graphs)."""
    if not experts.w13.is_cuda or not envs.DEVICE_EXPERTS.get():
        return packed_grouped
    key = (experts.w13.device, experts.kind, experts.group13, experts.group2, tuple(experts.w13.shape),
           tuple(experts.w2.shape), dtype, top_k, experts.activation)
    if key not in _checked:
        _checked[key] = packed_matches(packed_fused, experts, top_k, dtype)
        if not _checked[key]:
            logger.warning("packed %s experts of shape %s on %s are dequantized per call and grouped by expert "
                           "on the host: no CUDA graphs", experts.kind, tuple(experts.w13.shape), experts.w13.device)
    return packed_fused if _checked[key] else packed_grouped


def packed_matches(compute, experts: PackedExperts, top_k: int, dtype: torch.dtype) -> bool:
    """Whether compute(x, experts, weights, ids) is within the dtype's tolerance of float64 on the packed
    definition, on random inputs at every token count that picks another config of the fused kernel's table."""
    device = experts.w13.device
    g = torch.Generator(device=device).manual_seed(0)
    what = f"packed {experts.describe()} experts of shape {tuple(experts.w13.shape)} on {device}"
    for tokens, x, weights, ids in check_routes(experts.num_experts, experts.hidden, top_k, dtype, device, g):
        if not close_to_float64(compute.__name__, what, tokens, dtype, lambda: compute(x, experts, weights, ids),
                                lambda: reference_experts(x, None, None, weights, ids, packed=experts)):
            return False
    logger.info("%s: %s", what, compute.__name__)
    return True
