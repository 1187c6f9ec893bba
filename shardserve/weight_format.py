"""What a checkpoint's weights are, read without any model code: its quantization scheme (config.json's
quantization_config, parsed by `parse_quantization`), and a checkpoint tensor as weight loaders get it (a tensor,
a lazily read slice, or a quantized layer's `DequantizedWeight`: its shape without reading it, `shape_of`).

The config, the planner, the layers and the weight readers (weights/quantized.py, weights/fp4.py) all read these;
this module imports nothing of shardserve, so each of them may.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

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
    # ModelOpt's exclude_modules: the checkpoint modules left in the compute dtype, by name or shell-style pattern
    # (NVIDIA's NVFP4 Nemotron-3 checkpoints name their attention layers and the Mamba-2 layers before them).
    excluded: tuple[str, ...] = ()
    # transformers' modules_to_not_convert (FP8 and MXFP4 configs; Qwen's FP8 releases keep in_proj_ba and the
    # gates so): matched as transformers matches them (should_convert_module): a regular expression from the start
    # of the name up to a module boundary, or a suffix.
    not_converted: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the config says the checkpoint module `module` (e.g. model.layers.0.linear_attn.in_proj_ba) is
        stored quantized: not among ModelOpt's exclude_modules (a name, a module inside a named one, or a pattern's
        match); for AutoRound, its extra_config entry (an exact name first, then the first pattern found in it) with
        fewer than 16 bits, else inside block_name_to_quantize (when given) and not the LM head; for FP8 and MXFP4,
        not among modules_to_not_convert. Otherwise every layer that has quantized tensors is."""
        if any(module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p) for p in self.excluded):
            return False
        if any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p) for p in self.not_converted):
            return False
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
            kept = [p for p in self.excluded if p != "lm_head"]
            return (f"{self.method} (e2m1 in groups of {self.group_size}, weights only"
                    f"{f'; {len(kept)} exclude_modules entries kept 16-bit' if kept else ''})")
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
        return QuantScheme("fp8", weight_block=tuple(block) if block else None, not_converted=_not_converted(qc))
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


# NVFP4's and MXFP4's groups (weights/fp4.py).
NVFP4_GROUP = 16
MXFP4_GROUP = 32


def parse_modelopt(qc: dict[str, Any]) -> QuantScheme:
    """ModelOpt's quantization_config (or hf_quant_config.json's `quantization`, the same keys): NVFP4 weights in
    groups of 16 only; its 4-bit activations are computed in the compute dtype instead."""
    algo = str(qc.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise _unsupported(f"modelopt quant_algo {qc.get('quant_algo')!r} (NVFP4 only)")
    group = int(qc.get("group_size", NVFP4_GROUP))
    if group != NVFP4_GROUP:
        raise _unsupported(f"modelopt NVFP4 with groups of {group} (groups of 16 only)")
    return QuantScheme("nvfp4", group_size=NVFP4_GROUP, excluded=_module_names(qc, "exclude_modules"))


def parse_mxfp4(qc: dict[str, Any]) -> QuantScheme:
    """gpt-oss's `quant_method: mxfp4`: e2m1 codes in groups of 32 with a power-of-two (e8m0) scale each."""
    return QuantScheme("mxfp4", group_size=MXFP4_GROUP, not_converted=_not_converted(qc))


def _module_names(qc: dict[str, Any], key: str) -> tuple[str, ...]:
    """A config's list of module names (or patterns) under `key`, () where it has none."""
    names = qc.get(key) or ()
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{key} must be a list of module names, got {names!r}")
    return tuple(names)


def _not_converted(qc: dict[str, Any]) -> tuple[str, ...]:
    """transformers' modules_to_not_convert of a config, each a regular expression (QuantScheme.not_converted)."""
    names = _module_names(qc, "modules_to_not_convert")
    for name in names:
        try:
            re.compile(name)
        except re.error as e:
            raise ValueError(f"modules_to_not_convert entry {name!r} is not a regular expression: {e}") from None
    return names


# -- a checkpoint's tensors as weight loaders get them ------------------------------------------------

def as_tensor(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else torch.as_tensor(loaded)


def shape_of(loaded: Any) -> tuple[int, ...]:
    """The whole shape of a checkpoint tensor as weight loaders get it: a tensor, or a slice read on indexing
    (safetensors, quantized weights) that tells its shape with get_shape()."""
    return tuple(loaded.get_shape()) if hasattr(loaded, "get_shape") else tuple(loaded.shape)


class Checkpoint:
    """Access to a checkpoint's tensors by name: `slice` (lazily indexable) and `tensor` (read whole)."""

    def __init__(self, slice_of: Callable[[str], Any], tensor_of: Callable[[str], torch.Tensor]) -> None:
        self.slice, self.tensor = slice_of, tensor_of


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
