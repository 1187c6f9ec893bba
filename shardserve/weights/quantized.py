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

import dataclasses
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from shardserve.layers.linear import shape_of

SUPPORTED = ("fp8 (block-scaled, per-channel or per-tensor)", "compressed-tensors float-quantized (FP8)",
             "gptq (4-bit)", "auto-round (4-bit int, GPTQ packing)", "modelopt NVFP4 (weights only)",
             "mxfp4 (dense layers)")

# AutoRound's packing formats that store GPTQ's tensors (qweight, qzeros, scales, g_idx), and what is added to the
# stored zero points: auto_round:auto_gptq (AutoGPTQ's layout) stores them minus one; auto_round:gptqmodel and
# the plain auto_round layout store them as they are.
AUTO_ROUND_GPTQ_PACKING = {"auto_round:auto_gptq": 1, "auto_gptq": 1, "gptq": 1, "auto_round:gptqmodel": 0,
                           "gptqmodel": 0, "auto_round": 0}


class UnsupportedQuantization(ValueError):
    pass


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's linear layers are quantized (config.json's quantization_config)."""

    method: str  # "fp8", "gptq", or 4-bit floats (weights/fp4.py): "nvfp4" or "mxfp4"
    weight_block: tuple[int, int] | None = None  # FP8 scaled per [rows, cols] block
    group_size: int = 0  # GPTQ, NVFP4, MXFP4: input features per group (-1: one group)
    zero_offset: int = 0  # GPTQ: added to the stored zero points (1 in the `gptq` format)
    act_order: bool = False  # GPTQ desc_act: g_idx permutes the input features' groups
    # The untied LM head is quantized as well, and kept packed with the projections: GPTQ's `lm_head: true`
    # (GPTQModel's and AutoRound's option), or a compressed-tensors config whose targets take the head and whose
    # `ignore` does not. The `fp8` method's checkpoints leave the head in the compute dtype.
    lm_head: bool = False
    # AutoRound: the packing format named in the config, the bits its extra_config gives single modules (exact
    # checkpoint module names, or regular expressions searched in them), and block_name_to_quantize (None: every
    # module but the LM head is quantized unless extra_config says otherwise).
    packing: str = ""
    module_bits: tuple[tuple[str, int], ...] = ()
    quantized_blocks: tuple[str, ...] | None = None

    def quantizes(self, module: str) -> bool:
        """Whether the config says the checkpoint module `module` (e.g. model.layers.0.linear_attn.in_proj_ba) is
        stored quantized: its extra_config entry (an exact name first, then the first pattern found in it) with
        fewer than 16 bits, else inside block_name_to_quantize (when given) and not the LM head. Checkpoints of
        other methods name no such modules: every layer that has quantized tensors is."""
        if not self.packing:
            return True
        bits = dict(self.module_bits)
        if module in bits:
            return bits[module] < 16
        for key, value in self.module_bits:
            if _is_pattern(key) and re.search(key, module):
                return value < 16
        if self.quantized_blocks is not None:
            return any(module == block or module.startswith(block + ".") for block in self.quantized_blocks)
        return module != "lm_head"

    @property
    def e2m1(self) -> bool:
        """Whether the weights are 4-bit floats (NVFP4, MXFP4: weights/fp4.py)."""
        return self.method in ("nvfp4", "mxfp4")

    @property
    def group_columns(self) -> int:
        """Input columns a scale covers (FP8 blocks' columns, GPTQ's group size); 0 where one covers a whole row."""
        if self.method == "fp8":
            return self.weight_block[1] if self.weight_block else 0
        return max(self.group_size, 0)

    def describe(self) -> str:
        head = ", the LM head too" if self.lm_head else ""
        if self.method == "fp8":
            return f"fp8 (blocks of {self.weight_block[0]}x{self.weight_block[1]}{head})" if self.weight_block else \
                f"fp8{f' ({head[2:]})' if head else ''}"
        if self.e2m1:
            return f"{self.method} (e2m1 in groups of {self.group_size}, weights only)"
        if self.packing:
            kept = sum(bits >= 16 for _, bits in self.module_bits)
            return (f"auto-round 4-bit ({self.packing}, groups of {self.group_size}{head}"
                    f"{f', {kept} extra_config entries kept 16-bit' if kept else ''})")
        return f"gptq 4-bit (groups of {self.group_size}{head})"


def _unsupported(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{what} in config.json's quantization_config is not supported; shardserve "
                                   f"loads {', '.join(SUPPORTED)}")


def parse_quantization(cfg: dict[str, Any]) -> QuantScheme | None:
    """The checkpoint's quantization, None for a float checkpoint; an UnsupportedQuantization naming what is not
    supported, at start-up, before anything is loaded."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
            raise _unsupported(f"fp8 format {qc.get('fmt')!r} (e4m3 only)")
        block = qc.get("weight_block_size")
        return QuantScheme("fp8", weight_block=tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, tied=bool(cfg.get("tie_word_embeddings", False)))
    if method == "gptq":
        bits = qc.get("bits", 4)
        if bits != 4:
            raise _unsupported(f"gptq with {bits} bits (4 only)")
        checkpoint_format = str(qc.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise _unsupported(f"gptq checkpoint_format {checkpoint_format!r}")
        lm_head = bool(qc.get("lm_head", False))
        if lm_head and cfg.get("tie_word_embeddings", False):
            raise _unsupported("gptq lm_head: true with tie_word_embeddings (a quantized LM head that shares the "
                               "embedding's weights)")
        return QuantScheme("gptq", group_size=int(qc.get("group_size", 128)),
                           zero_offset=1 if checkpoint_format == "gptq" else 0, act_order=bool(qc.get("desc_act")),
                           lm_head=lm_head)
    if method in ("auto-round", "intel/auto-round", "auto_round"):
        return _auto_round(qc, tied=bool(cfg.get("tie_word_embeddings", False)))
    if method in ("modelopt", "mxfp4"):
        from shardserve.weights.fp4 import parse_modelopt, parse_mxfp4

        return parse_modelopt(qc) if method == "modelopt" else parse_mxfp4(qc)
    raise _unsupported(f"quantization method {method!r}" if method else "a quantization_config without quant_method")


_REGEX_TOKENS = (".*", "^", "$", "|", "(", ")", "[", "]", "?", "+", "\\")


def _is_pattern(key: str) -> bool:
    """Whether an extra_config key is a regular expression (AutoRound writes its regex_config so) rather than a
    module's name."""
    return any(token in key for token in _REGEX_TOKENS)


def _auto_round(qc: dict[str, Any], tied: bool) -> QuantScheme:
    """Intel AutoRound's export: 4-bit integers in one of the GPTQ packings; extra_config names the modules whose
    bits (or group size) differ from the config's, block_name_to_quantize the blocks that are quantized."""
    packing = str(qc.get("packing_format") or "auto_round:auto_gptq").lower()
    if packing not in AUTO_ROUND_GPTQ_PACKING:
        raise _unsupported(f"auto-round packing_format {packing!r} (GPTQ packings only: "
                           f"{', '.join(sorted(AUTO_ROUND_GPTQ_PACKING))})")
    bits, group_size = qc.get("bits", 4), int(qc.get("group_size", 128))
    if bits != 4:
        raise _unsupported(f"auto-round with {bits} bits (4 only)")
    data_type = str(qc.get("data_type", "int")).lower()
    if data_type != "int":
        raise _unsupported(f"auto-round data_type {data_type!r} (int only)")
    if (qc.get("act_bits") or 16) < 16:
        raise _unsupported(f"auto-round with {qc['act_bits']}-bit activations (weight-only only)")
    module_bits = []
    for module, entry in (qc.get("extra_config") or {}).items():
        entry = entry or {}
        module_bits.append((module, int(entry.get("bits", bits))))
        if module_bits[-1][1] >= 16:
            continue
        if module_bits[-1][1] != 4:
            raise _unsupported(f"auto-round extra_config {module!r} with {entry['bits']} bits (4 or 16 only)")
        if int(entry.get("group_size", group_size)) != group_size:
            raise _unsupported(f"auto-round extra_config {module!r} with groups of {entry['group_size']} (every "
                               f"4-bit module in the config's groups of {group_size})")
        if str(entry.get("data_type", data_type)).lower() != "int":
            raise _unsupported(f"auto-round extra_config {module!r} of data_type {entry['data_type']!r} (int only)")
    blocks = qc.get("block_name_to_quantize", qc.get("to_quant_block_names"))
    if isinstance(blocks, str):
        blocks = [b.strip() for b in blocks.split(",") if b.strip()]
    elif blocks is not None:  # a list of names, or of lists of a block's layer names (their common prefix)
        blocks = [os.path.commonprefix(b).rstrip(".") if isinstance(b, list) else str(b) for b in blocks]
    scheme = QuantScheme("gptq", group_size=group_size, zero_offset=AUTO_ROUND_GPTQ_PACKING[packing],
                         packing=packing, module_bits=tuple(module_bits),
                         quantized_blocks=tuple(blocks) if blocks is not None else None)
    lm_head = scheme.quantizes("lm_head")
    if lm_head and tied:
        raise _unsupported("auto-round with a 4-bit lm_head and tie_word_embeddings (a quantized LM head that shares "
                           "the embedding's weights)")
    return dataclasses.replace(scheme, lm_head=lm_head)


def _compressed_tensors(qc: dict[str, Any], tied: bool) -> QuantScheme:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise _unsupported(f"compressed-tensors format {fmt!r} (float-quantized only)")
    head = not tied and _quantizes_lm_head(qc)
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise _unsupported(f"compressed-tensors weights of {weights.get('num_bits')} bits, type "
                               f"{weights.get('type')!r} (8-bit float only)")
        if weights.get("strategy") == "block":
            return QuantScheme("fp8", weight_block=tuple(weights["block_structure"]), lm_head=head)
        if weights.get("strategy") not in ("channel", "tensor"):
            raise _unsupported(f"compressed-tensors FP8 strategy {weights.get('strategy')!r}")
    return QuantScheme("fp8", lm_head=head)


def _quantizes_lm_head(qc: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config quantizes the module `lm_head` (an nn.Linear in transformers): a config
    group targets it (the class "Linear", its name, or a "re:" pattern matching the name) and `ignore` does not
    name it. Entries match as compressed-tensors matches them: a name exactly, "re:" patterns from the start."""
    def names_head(entries) -> bool:
        return any(e == "lm_head" or (isinstance(e, str) and e.startswith("re:") and re.match(e[3:], "lm_head"))
                   for e in entries or ())

    targeted = any("Linear" in (group.get("targets") or ()) or names_head(group.get("targets"))
                   for group in (qc.get("config_groups") or {}).values())
    return targeted and not names_head(qc.get("ignore"))


# -- reading -------------------------------------------------------------------------------------------------

class Checkpoint:
    """Access to a checkpoint's tensors by name: `slice` (lazily indexable) and `tensor` (read whole)."""

    def __init__(self, slice_of: Callable[[str], Any], tensor_of: Callable[[str], torch.Tensor]) -> None:
        self.slice, self.tensor = slice_of, tensor_of


_FP8_PARTS = ("weight", "weight_scale_inv", "weight_scale", "input_scale")
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _quantized_modules(names: list[str], scheme: QuantScheme) -> dict[str, dict[str, str]]:
    """module prefix -> {part: tensor name} for every quantized linear layer of the checkpoint."""
    if scheme.e2m1:
        from shardserve.weights.fp4 import fp4_modules

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
        from shardserve.weights.fp4 import fp4_weight

        return fp4_weight
    return _fp8 if scheme.method == "fp8" else _gptq


class DequantizedWeight:
    """A quantized [out, in] matrix seen as its float32 values, indexed like a safetensors slice with at most
    two plain slices (rows, then columns): only the stored bytes of the rows and columns asked for are read."""

    def __init__(self, name: str, shape: tuple[int, int]) -> None:
        self.name = name
        self.shape = torch.Size(shape)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key) -> torch.Tensor:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > 2 or not all(isinstance(k, slice) or k is Ellipsis for k in keys):
            raise IndexError(f"{self.name}: a quantized weight is read by row and column ranges, not {key!r}")
        keys = [slice(None) if k is Ellipsis else k for k in keys] + [slice(None)] * (2 - len(keys))
        (r0, r1, rs), (c0, c1, cs) = (k.indices(n) for k, n in zip(keys, self.shape))
        if rs != 1 or cs != 1:
            raise IndexError(f"{self.name}: strided reads of a quantized weight are not supported")
        return self.read(r0, max(r0, r1), c0, max(c0, c1))

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        """Rows [r0, r1) and columns [c0, c1) of the matrix, float32."""
        raise NotImplementedError


def _expand(scale: torch.Tensor, first: int, count: int, block: int, dim: int) -> torch.Tensor:
    """Per-block scales (the blocks from first // block on) repeated over their rows (dim 0) or columns (dim 1),
    cut to `count` from `first`."""
    offset = first - first // block * block
    return scale.repeat_interleave(block, dim).narrow(dim, offset, count)


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
