"""Which linear layers of a model are packed (quantizable_layers, layout_for, pack_layers), and undoing it."""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardserve.layers.embedding import ParallelLMHead
from shardserve.layers.linear import ColumnParallelLinear, KernelLinear, RowParallelLinear
from shardserve.layers.quantization import format_of
from shardserve.layers.quantization.packed import PackedLayout, PackedWeights

logger = logging.getLogger(__name__)

def packed_layers(model: nn.Module) -> list[tuple[str, KernelLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, KernelLinear) and m.packed is not None]


def is_router(name: str) -> bool:
    """Routers and shared-expert gates stay in the compute dtype (checkpoints keep them so: a few rows that
    decide which experts run)."""
    last = name.rsplit(".", 1)[-1]
    return last in ("gate", "shared_expert_gate")


def quantizable_layers(model: nn.Module, head: bool = False) -> list[tuple[str, KernelLinear]]:
    """The column- and row-parallel layers a packed format applies to: every one but the routers and those that keep a
    dense weight (`keeps_dense_weight`: DeepSeek's kv_b_proj, read as W_UK and W_UV); with `head`, the untied LM head
    as well (vocabulary-parallel: a column-parallel layer over the vocabulary)."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not is_router(name)
            and not getattr(m, "keeps_dense_weight", False)
            or head and isinstance(m, ParallelLMHead) and not m.tied]


def layout_for(layer: KernelLinear, layout: PackedLayout) -> tuple[PackedLayout | None, str]:
    """The layout this rank's slice of `layer` takes (the group in local columns), or None and why it cannot be
    packed: a row-parallel slice that starts or ends inside a scale group, or of an act-order layer at more
    than one rank (its groups are spread over all columns)."""
    k = layer.weight.shape[1]
    if layout.group and k % layout.group:
        return None, f"its {k} input columns are not whole groups of {layout.group}"
    if format_of(layout.kind).per_byte > 1 and k % 2:
        return None, f"its {k} input columns do not pack in pairs"
    if not isinstance(layer, RowParallelLinear) or layer.comm is None:
        return layout, ""
    c0, c1 = layer.cols
    if layout.act_order:
        return None, "an act-order layer split by input columns"
    if layout.group and (c0 % layout.group or (c1 - c0) % layout.group):
        return None, f"its columns [{c0}, {c1}) split groups of {layout.group}"
    return layout, ""


def pack_layers(model: nn.Module, names: set[str] | None, layout: PackedLayout, device: torch.device | str,
                log: bool = True, head: bool = False) -> int:
    """Make the quantizable layers (those in `names`, the LM head among them where named; None: all, the head only
    with `head`) packed before loading; the others get their dense weights (layers built under deferred_weights()).
    Returns how many were packed."""
    chosen = {name for name, _ in quantizable_layers(model, head=head or names is not None)
              if names is None or name in names}
    count, unpacked = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, KernelLinear):
            continue
        local = None
        if name in chosen:
            local, why = layout_for(module, layout)
            if local is None:
                unpacked.append(f"{name} ({why})")
        if local is not None:
            module.packed = PackedWeights(module, local, device)
            count += 1
        else:
            module.materialize(device)
    if log:
        log_kept_dequantized("layers keep dequantized weights", unpacked, layout)
    return count


def log_kept_dequantized(what: str, unpacked: list[str], layout: PackedLayout) -> None:
    """One line naming the first few of the modules (with why) that could not stay packed in `layout`."""
    if unpacked:
        logger.info("%d %s rather than %s: %s", len(unpacked), what, layout.describe(),
                    "; ".join(unpacked[:4]) + (" ..." if len(unpacked) > 4 else ""))


def unpack_all(model: nn.Module) -> int:
    layers = packed_layers(model)
    for _, layer in layers:
        layer.packed.unpack(layer)
    return len(layers)
