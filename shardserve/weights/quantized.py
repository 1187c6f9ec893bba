"""Quantized checkpoints (FP8, 4-bit GPTQ, and 4-bit float NVFP4 / MXFP4 in weights/fp4.py), read as the float matrices they encode.

A quantized linear layer's tensors (FP8: `weight` in float8_e4m3fn with `weight_scale_inv` per block or
`weight_scale` per output channel or per tensor; GPTQ: `qweight`, `qzeros`, `scales`, `g_idx`) come out of
`dequantized_checkpoint` as one `{module}.weight` whose value is a `DequantizedWeight`: it has the matrix's
[out features, in features] shape and is sliced like a safetensors slice, so a rank's weight loader asks for
its rows (column-parallel layers) or columns (row-parallel layers) and only the packed bytes and scales
those need are read and dequantized, to float32. Everything else passes through unchanged.

Layers hold the dequantized values in the compute dtype: a quantized checkpoint loads and serves with the same
tokens as its dequantized float weights, on every device and at every tensor-parallel size, but takes the
compute dtype's memory and speed.

GPTQ packing (the `gptq` checkpoint format, AutoGPTQ's and AutoRound's GPTQ export): `qweight` [K / 8, N]
int32 holds eight 4-bit values along the input dimension, value j of row i being input feature 8 i + j;
`qzeros` [groups, N / 8] packs the zero points along the output dimension, stored minus one (`gptq_v2`:
as they are); `scales` [groups, N]; `g_idx` [K] the group of each input feature (absent: feature // group
size). The weight is W[n, k] = scales[g, n] * (q[k, n] - zero[g, n]) with g = g_idx[k].

AutoRound (`quant_method: auto-round`) exports 4-bit integers in these tensors: packing_format
`auto_round:auto_gptq` stores the zero points minus one, `auto_round:gptqmodel` (and plain `auto_round`) as they
are. Which modules stay 16-bit is read from the checkpoint: its config's extra_config (bits >= 16) and
block_name_to_quantize, and the tensors it has (a module stored as `weight` loads as a float layer); a module the
config keeps 16-bit but the checkpoint stores packed is refused.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator

import torch

from shardserve.weight_format import Checkpoint, DequantizedWeight, QuantScheme, _expand, shape_of
from shardserve.weights.fp4 import fp4_modules, fp4_weight

# -- reading -------------------------------------------------------------------------------------------------

_FP8_PARTS = ("weight", "weight_scale_inv", "weight_scale", "input_scale")
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _quantized_modules(names: list[str], scheme: QuantScheme) -> dict[str, dict[str, str]]:
    """module prefix -> {part: tensor name} for every quantized linear layer of the checkpoint."""
    if scheme.e2m1:
        return fp4_modules(names, scheme)
    parts: dict[str, dict[str, str]] = defaultdict(dict)
    known = _FP8_PARTS if scheme.method == "fp8" else _GPTQ_PARTS
    for name in names:
        prefix, _, part = name.rpartition(".")
        if part in known:
            parts[prefix][part] = name
    if scheme.method == "fp8":
        return {p: s for p, s in parts.items() if "weight_scale_inv" in s or "weight_scale" in s}
    modules = {p: s for p, s in parts.items() if "qweight" in s}
    # An AutoRound config names the modules it keeps 16-bit (extra_config, block_name_to_quantize): a checkpoint
    # that stores one of them packed disagrees with its own config, and neither is taken over the other.
    contradicted = sorted(p for p in modules if not scheme.quantizes(p))
    if contradicted:
        raise ValueError(f"the checkpoint stores {len(contradicted)} modules 4-bit (e.g. {contradicted[0]}.qweight) "
                         f"that its quantization_config keeps 16-bit (extra_config or block_name_to_quantize)")
    return modules


def quantized_prefixes(names: list[str], scheme: QuantScheme) -> list[str]:
    """The checkpoint's quantized linear layers, by module prefix (e.g. model.layers.0.self_attn.q_proj)."""
    return list(_quantized_modules(names, scheme))


def count_dequantized(names: list[str], scheme: QuantScheme) -> int:
    """How many tensors dequantized_checkpoint yields for a checkpoint of these tensor names."""
    modules = _quantized_modules(names, scheme)
    return len(names) - sum(len(parts) for parts in modules.values()) + len(modules)


def dequantized_checkpoint(names: list[str], checkpoint: Checkpoint, scheme: QuantScheme
                           ) -> Iterator[tuple[str, Any]]:
    """(name, sliceable) for every tensor of the checkpoint, each quantized layer's tensors replaced by one
    `{module}.weight` (a DequantizedWeight), yielded where its first tensor was."""
    modules = _quantized_modules(names, scheme)
    position = {name: i for i, name in enumerate(names)}
    first_part = {min(parts.values(), key=position.__getitem__): prefix for prefix, parts in modules.items()}
    for name in names:
        prefix, _, part = name.rpartition(".")
        parts = modules.get(prefix)
        if parts is None or parts.get(part) != name:
            yield name, checkpoint.slice(name)
        elif name in first_part:
            yield f"{prefix}.weight", _reader(scheme)(prefix, parts, checkpoint, scheme)


def _reader(scheme: QuantScheme) -> Callable[..., "DequantizedWeight"]:
    """The function that makes one quantized layer's DequantizedWeight from its tensors."""
    if scheme.e2m1:
        return fp4_weight
    return _fp8 if scheme.method == "fp8" else _gptq


class Fp8Weight(DequantizedWeight):
    """float8_e4m3fn values times a scale per [bn, bk] block, per output row, or per tensor."""

    def __init__(self, name: str, weight, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
        shape = shape_of(weight)
        super().__init__(name, shape)
        self.weight, self.scale, self.block = weight, scale.float(), block
        rows, cols = shape
        if scale.numel() == 1:
            self.kind = "tensor"
        elif block is not None and scale.dim() == 2 and tuple(scale.shape) == (-(-rows // block[0]),
                                                                              -(-cols // block[1])):
            self.kind = "block"
        elif scale.numel() == rows:
            self.kind = "channel"
            self.scale = self.scale.reshape(rows, 1)
        else:
            raise ValueError(f"{name}: FP8 scale of shape {tuple(scale.shape)} fits neither blocks of {block}, "
                             f"nor the {rows} output rows, nor the whole [{rows}, {cols}] tensor")

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        values = torch.as_tensor(self.weight[r0:r1, c0:c1])
        if values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.name}: an FP8 weight must be stored as float8_e4m3fn, found {values.dtype}")
        values = values.float()
        if self.kind == "tensor":
            return values * self.scale.reshape(())
        if self.kind == "channel":
            return values * self.scale[r0:r1]
        if r1 == r0 or c1 == c0:
            return values
        bn, bk = self.block
        blocks = self.scale[r0 // bn:(r1 - 1) // bn + 1, c0 // bk:(c1 - 1) // bk + 1]
        return values * _expand(_expand(blocks, r0, r1 - r0, bn, 0), c0, c1 - c0, bk, 1)

    def packed_group(self, c0: int, c1: int) -> int | None:
        """How many of columns [c0, c1) one scale covers in `read_packed` (all of them: per row), or None where
        the range starts inside a scale block (its per-rank form would need two scales in one block)."""
        if self.kind != "block":
            return c1 - c0
        return self.block[1] if c0 % self.block[1] == 0 else None

    def read_packed(self, r0: int, r1: int, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r0, r1) and columns [c0, c1) as stored (float8_e4m3fn) and their scales as float32
        [rows, ceil(columns / packed_group)]: a row's values times the scale of their column group."""
        if self.packed_group(c0, c1) is None:
            raise ValueError(f"{self.name}: columns from {c0} start inside a scale block of {self.block[1]}")
        values = torch.as_tensor(self.weight[r0:r1, c0:c1])
        if values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.name}: an FP8 weight must be stored as float8_e4m3fn, found {values.dtype}")
        if self.kind == "tensor":
            return values, self.scale.reshape(1, 1).expand(r1 - r0, 1).contiguous()
        if self.kind == "channel":
            return values, self.scale[r0:r1].contiguous()
        bn, bk = self.block
        rows = torch.arange(r0, r1) // bn
        return values, self.scale[:, c0 // bk:-(-c1 // bk)].index_select(0, rows).contiguous()


def _fp8(prefix: str, parts: dict[str, str], checkpoint: Checkpoint, scheme: QuantScheme) -> Fp8Weight:
    if "weight" not in parts:
        raise ValueError(f"{prefix}: the checkpoint has FP8 scales but no weight")
    scale = checkpoint.tensor(parts.get("weight_scale_inv") or parts["weight_scale"])  # both multiply
    return Fp8Weight(parts["weight"], checkpoint.slice(parts["weight"]), scale, scheme.weight_block)


_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values from each int32 along `dim` (value j in bits 4j..4j+3), as int32 in 0..15."""
    if dim == 0:
        return ((packed.unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 15).reshape(-1, packed.shape[1])
    return ((packed.unsqueeze(2) >> _SHIFTS.view(1, 1, 8)) & 15).reshape(packed.shape[0], -1)


class GptqWeight(DequantizedWeight):
    def __init__(self, name: str, qweight, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                 scheme: QuantScheme) -> None:
        packed_rows, out_features = shape_of(qweight)
        in_features = packed_rows * 8
        super().__init__(name, (out_features, in_features))
        if qzeros.dtype != torch.int32 or scales.shape[1] != out_features or qzeros.shape[1] * 8 != out_features:
            raise ValueError(f"{name}: GPTQ tensors disagree: qweight {[packed_rows, out_features]}, qzeros "
                             f"{list(qzeros.shape)} ({qzeros.dtype}), scales {list(scales.shape)}")
        if g_idx is None:
            size = scheme.group_size if scheme.group_size > 0 else in_features
            g_idx = torch.arange(in_features) // size
        if g_idx.numel() != in_features or int(g_idx.max()) >= scales.shape[0] or int(g_idx.min()) < 0:
            raise ValueError(f"{name}: g_idx names groups outside the {scales.shape[0]} of scales")
        self.qweight, self.g_idx = qweight, g_idx.long()
        self.zeros = unpack_int4(qzeros, 1) + scheme.zero_offset  # [groups, N]
        self.scales = scales.float()

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        first = c0 // 8
        packed = torch.as_tensor(self.qweight[first:-(-c1 // 8), r0:r1])
        q = unpack_int4(packed, 0)[c0 - first * 8:c1 - first * 8]  # [in features c0..c1, out features r0..r1]
        groups = self.g_idx[c0:c1]
        zeros = self.zeros[:, r0:r1].index_select(0, groups)  # whole rows: faster than indexing both dims
        scales = self.scales[:, r0:r1].index_select(0, groups)
        return q.sub_(zeros).float().mul_(scales).t().contiguous()

    def packed_group(self, c0: int, c1: int) -> int | None:
        """The group size of columns [c0, c1) in `read_packed`, or None where they are not whole groups of one
        size once sorted by group (a row-parallel slice of an act-order layer, or one starting mid-group)."""
        counts = torch.bincount(self.g_idx[c0:c1])
        sizes = counts[counts > 0].unique()
        if sizes.numel() != 1:
            return None
        size = int(sizes[0])
        whole = int(torch.bincount(self.g_idx).max())
        return size if size == whole or c1 - c0 == size else None

    def read_packed(self, r0: int, r1: int, c0: int, c1: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows [r0, r1), columns [c0, c1) as 4-bit codes: (codes uint8 [rows, columns] in 0..15, scales and zero
        points float32 [rows, groups], perm). Columns are sorted by group so each group is `packed_group`
        consecutive columns; perm (None when already in order) says which input feature each column holds."""
        if self.packed_group(c0, c1) is None:
            raise ValueError(f"{self.name}: columns [{c0}, {c1}) are not whole groups of one size")
        first = c0 // 8
        packed = torch.as_tensor(self.qweight[first:-(-c1 // 8), r0:r1])
        q = unpack_int4(packed, 0)[c0 - first * 8:c1 - first * 8]  # [columns, rows]
        groups = self.g_idx[c0:c1]
        perm = torch.argsort(groups, stable=True)
        in_order = bool((perm == torch.arange(perm.numel())).all())
        if not in_order:
            q, groups = q.index_select(0, perm), groups[perm]
        used = torch.unique_consecutive(groups)
        scales = self.scales[used, r0:r1].t().contiguous()
        zeros = self.zeros[used, r0:r1].t().float().contiguous()
        return q.t().to(torch.uint8).contiguous(), scales, zeros, None if in_order else perm


def _gptq(prefix: str, parts: dict[str, str], checkpoint: Checkpoint, scheme: QuantScheme) -> GptqWeight:
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise ValueError(f"{prefix}: the GPTQ layer lacks {', '.join(missing)}")
    g_idx = checkpoint.tensor(parts["g_idx"]) if "g_idx" in parts else None
    return GptqWeight(parts["qweight"], checkpoint.slice(parts["qweight"]), checkpoint.tensor(parts["qzeros"]),
                      checkpoint.tensor(parts["scales"]), g_idx, scheme)
