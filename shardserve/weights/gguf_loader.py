"""Read GGUF checkpoints (llama.cpp's file format) as Hugging Face configs and tensors.

The header is parsed here rather than with `gguf.GGUFReader`, which decodes every entry of
the tokenizer vocabulary up front (seconds for a 50k-token vocabulary); this parser skips
array contents, so reading a header takes milliseconds. Tensor data is memory-mapped and
dequantized one tensor at a time with `gguf.quants.dequantize`.

Supported architectures: llama (Mixtral too: llama with experts), qwen2, qwen3, qwen2moe, qwen3moe. A mixture of experts'
merged expert tensors (blk.N.ffn_{gate,up,down}_exps, one [E, ...] tensor each) come out as the per-expert
tensors of a Hugging Face checkpoint, and the router (ffn_gate_inp) as mlp.gate.
"""

from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# Little-endian layouts of GGUF's scalar metadata types (strings and arrays are read separately).
_SCALAR_STRUCTS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32 = _SCALAR_STRUCTS[GGUFValueType.UINT32]
_U64 = _SCALAR_STRUCTS[GGUFValueType.UINT64]

# GGUF architecture -> (HF model class, HF model_type).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# llama.cpp writes Mixtral as llama with {arch}.expert_count set.
_MIXTRAL = ("MixtralForCausalLM", "mixtral")

_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MODULE_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
    # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Merged expert tensors [E, rows, cols] -> the per-expert module name under mlp.experts.{e}.
_EXPERT_MODULE_NAMES: dict[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3 rope frequency factors: llama.cpp stores them as a tensor, HF derives them from the config.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"

# Optional rope scaling metadata (under "<arch>.rope.scaling.") -> HF rope_scaling key.
_ROPE_SCALING_KEYS: dict[str, str] = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


@dataclass(frozen=True)
class GGUFArray:
    """An array-valued metadata entry. Its items are skipped, not read."""

    item_type: GGUFValueType
    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order, outermost first (GGUF lists dimensions innermost first)
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the tensor's data in the file

    @property
    def nbytes(self) -> int:
        block_size, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block_size * block_bytes


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]  # array values are GGUFArray placeholders
    tensors: list[GGUFTensorInfo]
    data_offset: int  # where tensor data starts: every byte before it belongs to the header


class _HeaderParser:
    """Sequential little-endian reader over the bytes of a GGUF header."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self._buffer = buffer
        self.pos = 0

    def raw(self, size: int) -> bytes:
        data = self._buffer[self.pos : self.pos + size]
        if len(data) != size:
            raise EOFError("the GGUF header ends early")
        self.pos += size
        return data

    def scalar(self, layout: struct.Struct) -> Any:
        (value,) = layout.unpack_from(self._buffer, self.pos)
        self.pos += layout.size
        return value

    def string(self) -> str:
        return self.raw(self.scalar(_U64)).decode("utf-8", errors="replace")

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            return self.array()
        value = self.scalar(_SCALAR_STRUCTS[value_type])
        if value_type == GGUFValueType.FLOAT32:
            # The shortest decimal that round-trips through float32, so 1e-5 reads as 1e-5.
            value = float(str(np.float32(value)))
        return value

    def array(self) -> GGUFArray:
        item_type = GGUFValueType(self.scalar(_U32))
        length = self.scalar(_U64)
        self._skip_items(item_type, length)
        return GGUFArray(item_type, length)

    def _skip_items(self, item_type: GGUFValueType, count: int) -> None:
        if item_type == GGUFValueType.STRING:
            for _ in range(count):
                self.pos += _U64.size + _U64.unpack_from(self._buffer, self.pos)[0]
        elif item_type == GGUFValueType.ARRAY:
            for _ in range(count):
                self.array()
        else:
            self.pos += count * _SCALAR_STRUCTS[item_type].size

    def tensor_info(self) -> GGUFTensorInfo:
        """A tensor directory entry; its offset is relative to the start of tensor data."""
        name = self.string()
        n_dims = self.scalar(_U32)
        dims = [self.scalar(_U64) for _ in range(n_dims)]
        ggml_type = GGMLQuantizationType(self.scalar(_U32))
        offset = self.scalar(_U64)
        return GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset)


def read_gguf_header(path: str) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor directory, without touching tensor data."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        parser = _HeaderParser(buffer)
        try:
            return _parse_header(path, parser)
        except (EOFError, struct.error) as error:
            raise ValueError(f"{path}: truncated GGUF header") from error


def _parse_header(path: str, parser: _HeaderParser) -> GGUFHeader:
    _check_preamble(path, parser)
    tensor_count = parser.scalar(_U64)
    metadata_count = parser.scalar(_U64)
    metadata = {}
    for _ in range(metadata_count):
        key = parser.string()
        metadata[key] = parser.value(GGUFValueType(parser.scalar(_U32)))
    relative = [parser.tensor_info() for _ in range(tensor_count)]
    # Tensor data starts at the first aligned offset after the tensor directory.
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_offset = -(-parser.pos // alignment) * alignment
    tensors = [replace(t, offset=data_offset + t.offset) for t in relative]
    return GGUFHeader(metadata, tensors, data_offset)


def _check_preamble(path: str, parser: _HeaderParser) -> None:
    magic = parser.raw(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (bad magic {magic!r})")
    version = parser.scalar(_U32)
    if version in _SUPPORTED_VERSIONS:
        return
    if int.from_bytes(version.to_bytes(4, "little"), "big") in _SUPPORTED_VERSIONS:
        raise ValueError(f"{path} is a big-endian GGUF file, which is not supported")
    raise ValueError(f"{path} has GGUF version {version}; supported: {_SUPPORTED_VERSIONS}")


def read_gguf_config(path: str) -> dict[str, Any]:
    """An HF-style config.json dict for the model in a GGUF file."""
    return _hf_config(read_gguf_header(path), path)


def _hf_config(header: GGUFHeader, path: str) -> dict[str, Any]:
    meta = header.metadata
    arch = _architecture(meta, path)
    num_experts = meta.get(f"{arch}.expert_count", 0)
    model_class, model_type = _MIXTRAL if arch == "llama" and num_experts else _ARCHITECTURES[arch]
    tensors = {t.name: t for t in header.tensors}

    def arch_value(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden_size = arch_value("embedding_length")
    num_heads = arch_value("attention.head_count")
    embedding = tensors.get("token_embd.weight")
    config: dict[str, Any] = {
        "architectures": [model_class],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": meta.get(f"{arch}.feed_forward_length") or arch_value("expert_feed_forward_length"),
        "num_hidden_layers": arch_value("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": arch_value("attention.head_count_kv", num_heads),
        "head_dim": arch_value("attention.key_length", hidden_size // num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": arch_value("attention.layer_norm_rms_epsilon"),
        "rope_theta": arch_value("rope.freq_base", 10000.0),
        "max_position_embeddings": arch_value("context_length"),
        "vocab_size": embedding.shape[0] if embedding is not None else arch_value("vocab_size"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": _torch_dtype(header.tensors),
        # Dequantized values are exact in float32 only: a CPU computing in float32 keeps them so.
        "gguf_quantized": _quantized(header.tensors),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if num_experts:
        config.update(_experts_config(meta, arch, model_type, num_experts, arch_value))
    if (rope_scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = rope_scaling
    if _ROPE_FREQS_TENSOR in tensors:
        logger.warning(
            "%s: %s is ignored, llama3 rope scaling is not reconstructed", path, _ROPE_FREQS_TENSOR
        )
    return config


def _experts_config(meta: dict[str, Any], arch: str, model_type: str, num_experts: int, arch_value) -> dict[str, Any]:
    """The mixture-of-experts keys of the HF config. Qwen2/3-MoE: every layer sparse (llama.cpp has no dense
    layers for them), weights renormalised over the chosen experts where the file says so (by default for
    Qwen3-MoE, not for Qwen2-MoE, as in transformers), Qwen2-MoE's shared expert of
    expert_shared_feed_forward_length features; Mixtral: the experts' size is feed_forward_length."""
    top_k = arch_value("expert_used_count")
    if model_type == "mixtral":
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
    config = {"num_experts": num_experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": arch_value("expert_feed_forward_length"),
              "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", model_type == "qwen3_moe")),
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    if model_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = arch_value("expert_shared_feed_forward_length")
    return config


def _architecture(meta: dict[str, Any], path: str) -> str:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (supported: {supported})")
    return arch


def _torch_dtype(tensors: list[GGUFTensorInfo]) -> str:
    types = {t.ggml_type for t in tensors}
    if types <= {GGMLQuantizationType.F32}:
        return "float32"
    if types <= {GGMLQuantizationType.F32, GGMLQuantizationType.F16}:
        return "float16"
    return "bfloat16"  # bf16 or quantized weights: bf16 has the range to hold them (GPUs compute in it)


def _quantized(tensors: list[GGUFTensorInfo]) -> bool:
    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    return any(t.ggml_type not in plain for t in tensors)


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type")
    if kind in (None, "none"):
        # Files from older converters store linear scaling as a bare factor.
        linear_factor = meta.get(f"{arch}.rope.scale_linear", 1.0)
        return None if linear_factor == 1.0 else {"rope_type": "linear", "factor": linear_factor}
    scaling = {"rope_type": kind}
    for gguf_key, hf_key in _ROPE_SCALING_KEYS.items():
        if prefix + gguf_key in meta:
            scaling[hf_key] = meta[prefix + gguf_key]
    return scaling


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors that are not parameters. For merged expert
    tensors, the name with "{expert}" in place of the expert's number."""
    if gguf_name == _ROPE_FREQS_TENSOR:
        return None
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is not None and match.group(2) in _EXPERT_MODULE_NAMES and match.group(3) == "weight":
        return f"model.layers.{match.group(1)}.mlp.experts.{{expert}}.{_EXPERT_MODULE_NAMES[match.group(2)]}.weight"
    if match is None or match.group(2) not in _LAYER_MODULE_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_MODULE_NAMES[module]}.{kind}"


def count_gguf_tensors(path: str) -> int:
    """How many tensors `iter_gguf_tensors` yields, from the header alone."""
    count = 0
    for info in read_gguf_header(path).tensors:
        name = hf_tensor_name(info.name)
        count += 0 if name is None else info.shape[0] if "{expert}" in name else 1
    return count


def iter_gguf_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor in HF shape and layout) for every parameter, one at a time."""
    header = read_gguf_header(path)
    config = _hf_config(header, path)
    permuted_heads = _permuted_rope_heads(config)
    # A plain ndarray view of the file map: numpy's memmap subclass makes every slice slow.
    data = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    for info in header.tensors:
        name = hf_tensor_name(info.name)
        if name is None:
            continue
        tensor = _dequantize(data, info)
        if "{expert}" in name:
            for expert, weight in enumerate(tensor):  # [E, rows, cols]: one expert's matrix at a time
                yield name.format(expert=expert), weight
            continue
        suffix = info.name.split(".", 2)[-1]  # "blk.3.attn_q.weight" -> "attn_q.weight"
        if (num_heads := permuted_heads.get(suffix)) is not None:
            tensor = _interleaved_to_half_rotation(tensor, num_heads)
        if suffix == "ffn_gate_inp_shexp.weight":
            tensor = tensor.reshape(1, -1)  # llama.cpp keeps the shared expert's one-output gate as a vector
        yield name, tensor


def _permuted_rope_heads(config: dict[str, Any]) -> dict[str, int]:
    """The head count of each projection whose rows llama.cpp permuted, by GGUF tensor suffix."""
    if config["model_type"] not in ("llama", "mixtral"):
        return {}  # llama.cpp keeps HF's row order for qwen2, qwen3 and qwen3moe
    return {
        "attn_q.weight": config["num_attention_heads"],
        "attn_k.weight": config["num_key_value_heads"],
    }


def _dequantize(data: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
    block_size, block_bytes = GGML_QUANT_SIZES[info.ggml_type]
    row_bytes = info.shape[-1] // block_size * block_bytes
    raw = data[info.offset : info.offset + info.nbytes]
    if raw.size != info.nbytes:
        raise ValueError(f"GGUF tensor {info.name} runs past the end of the file")
    raw = raw.reshape(*info.shape[:-1], row_bytes)
    values = dequantize(raw, info.ggml_type)
    if not values.flags.writeable:
        values = values.copy()  # F32 data comes back as a view of the read-only file map
    return torch.from_numpy(values)


def _interleaved_to_half_rotation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of the rows of a q or k projection.

    llama.cpp's rope rotates adjacent pairs of each head's dimensions, HF's rotates the first
    half against the second, so the converter reorders rows: within a head of dimension d,
    HF row h * d/2 + j (h in {0, 1}, j < d/2) is stored as row 2j + h.
    """
    head_dim = weight.shape[0] // num_heads
    per_head = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()
