"""Loads checkpoint tensors into a sharded model, each rank reading only the slices it owns.

For safetensors, `safe_open(...).get_slice(name)` is handed to the parameter's weight_loader, which
indexes the rows or columns it owns: only those bytes are read from disk into this rank's memory.

Rank 0 draws a progress bar over all the checkpoint's tensors on its terminal; it stays quiet when
stderr is not a terminal or INFO messages are not logged (`--log-level warning`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import sys
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors import safe_open
from torch import nn

from shardserve.attention import kv_quant
from shardserve.config import ModelConfig
from shardserve.layers.attention import PagedAttention
from shardserve.layers.linear import load_whole
from shardserve.layers.quantization.packed import PACKED_PARTS
from shardserve.layers.quantization.selection import quantizable_layers
from shardserve.weight_format import shape_of
from shardserve.weights.synthetic import expected_checkpoint_shapes, iter_synthetic_checkpoint
from shardserve.weights.quantized import (Checkpoint, QuantScheme, count_dequantized, dequantized_checkpoint,
                                          quantized_prefixes)

# Tensors some checkpoints carry that the model derives itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    return files


def iter_checkpoint(model_path: str, quantization: QuantScheme | None = None) -> Iterator[tuple[str, Any]]:
    """(name, lazily sliceable tensor) for every tensor of the checkpoint; with `quantization`, each quantized
    layer's tensors as one `{layer}.weight` that reads as the float values they encode."""
    if model_path.endswith(".gguf"):
        from shardserve.weights.gguf_loader import iter_gguf_tensors

        yield from iter_gguf_tensors(model_path)
        return
    if quantization is None:
        for path in safetensors_files(model_path):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_slice(name)
        return
    # A quantized layer's tensors may lie in different files: all stay open (their headers only are read).
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(path, framework="pt")) for path in safetensors_files(model_path)]
        holder = {name: f for f in files for name in f.keys()}
        checkpoint = Checkpoint(lambda name: holder[name].get_slice(name), lambda name: holder[name].get_tensor(name))
        yield from dequantized_checkpoint(list(holder), checkpoint, quantization)


def count_checkpoint_tensors(model_path: str, quantization: QuantScheme | None = None) -> int:
    """How many tensors `iter_checkpoint` yields, read from the headers only."""
    if model_path.endswith(".gguf"):
        from shardserve.weights.gguf_loader import count_gguf_tensors

        return count_gguf_tensors(model_path)
    names = []
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            names += f.keys()
    return len(names) if quantization is None else count_dequantized(names, quantization)


def quantized_module_names(model_path: str, scheme: QuantScheme, model_class) -> set[str]:
    """The model's modules that receive a quantized checkpoint tensor (e.g. model.layers.0.self_attn.qkv_proj
    for q_proj, k_proj and v_proj), read from the safetensors headers."""
    names = []
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            names += f.keys()
    packed = getattr(model_class, "packed_modules", {})
    own_names = getattr(model_class, "checkpoint_name", lambda name: None)
    renamed = getattr(model_class, "renamed_checkpoint_prefixes", {})
    skipped = tuple(getattr(model_class, "skipped_checkpoint_prefixes", {}))
    modules = set()
    for prefix in quantized_prefixes(names, scheme):
        name = model_tensor_name(f"{prefix}.weight", renamed)
        if name.startswith(skipped):
            continue
        target, _ = own_names(name) or _resolve(name, packed)
        modules.add(target.removesuffix(".weight"))
    return modules


def configured_quantized_modules(model: nn.Module, scheme: QuantScheme) -> set[str] | None:
    """Without a checkpoint's tensors (dummy weights): the model's modules its quantization_config stores
    quantized, or None where the config names no 16-bit modules (every quantizable layer then is). A fused module
    is quantized when the config quantizes it and each checkpoint module that loads into it (q_proj, k_proj and
    v_proj for qkv_proj; an expert block's first expert's projections for its w13 (non-gated: w1) and w2)."""
    if not scheme.packing and not scheme.excluded and not scheme.not_converted:
        return None
    from shardserve.layers.moe import SparseMoE
    from shardserve.layers.nongated_experts import NonGatedExperts

    packed = getattr(model, "packed_modules", {})
    renamed = getattr(model, "renamed_checkpoint_prefixes", {})

    def stored(name: str) -> str:  # the checkpoint's name of a model module
        for prefix, own in renamed.items():
            if name.startswith(own):
                return prefix + name[len(own):]
        return name

    def quantized(names: list[str]) -> bool:
        return all(scheme.quantizes(stored(n)) for n in names)

    modules = set()
    for name, _ in quantizable_layers(model, head=scheme.lm_head):
        parts = [name[:-len(fused)] + part for part, (fused, _) in packed.items() if name.endswith(f".{fused}")]
        if quantized([name, *parts]):
            modules.add(name)
    for name, moe in model.named_modules():
        if isinstance(moe, SparseMoE) and quantized([f"{name}.experts.0.{p}" for p in
                                                     ("gate_proj", "up_proj", "down_proj")]):
            modules |= {f"{name}.w13", f"{name}.w2"}
        if isinstance(moe, NonGatedExperts) and quantized([f"{name}.0.{p}" for p in ("up_proj", "down_proj")]):
            modules |= {f"{name}.w1", f"{name}.w2"}
    return modules


def load_weights(model: nn.Module, model_path: str, tied_embeddings: bool,
                 quantization: QuantScheme | None = None) -> None:
    """Load the checkpoint at `model_path` (safetensors directory or .gguf file) into `model`; `quantization`:
    how its linear layers are quantized (ModelConfig.quantization), read as the values they encode."""
    source = f"checkpoint {model_path!r}"
    console = progress_console()
    if console is None:
        load_tensors(model, iter_checkpoint(model_path, quantization), tied_embeddings, source)
        return
    label = f"loading {os.path.basename(model_path.rstrip(os.sep))}"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tensors"),
                  TimeElapsedColumn(), console=console) as progress:
        tensors = progress.track(iter_checkpoint(model_path, quantization),
                                 total=count_checkpoint_tensors(model_path, quantization), description=label)
        load_tensors(model, tensors, tied_embeddings, source)


def progress_console() -> Console | None:
    """Where the loading bar goes: stderr of rank 0 (or of a process outside any group) when it is a
    terminal and INFO messages are logged; None for no bar."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    if not sys.stderr.isatty() or not logging.getLogger(__name__).isEnabledFor(logging.INFO):
        return None
    return Console(file=sys.stderr)


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, Any]], tied_embeddings: bool, source: str) -> None:
    """Hand each (checkpoint name, sliceable tensor) of `tensors` to its parameter's weight_loader.

    Names are Hugging Face checkpoint names; q/k/v and gate/up tensors land in their fused parameter.
    Every parameter must be loaded (a tied LM head shares the embedding's) and every tensor must have
    a place in the model; `source` names where the tensors come from in the errors.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected_shapes(model)
    packed = getattr(model, "packed_modules", {})
    own_names = getattr(model, "checkpoint_name", lambda name: None)  # e.g. experts' tensors into their stacks
    unused = getattr(model, "unused_checkpoint_prefixes", ())  # parts of a checkpoint the model does not serve
    renamed = getattr(model, "renamed_checkpoint_prefixes", {})  # e.g. an image-text checkpoint's text model
    skipped = getattr(model, "skipped_checkpoint_prefixes", {})  # e.g. its vision tower: counted, then logged
    skipped_counts = dict.fromkeys(skipped, 0)
    folded = getattr(model, "folded_parameters", {})  # parameter -> (where it went, its shard ids there)
    attention_blocks = {name.rpartition(".")[0]: m for name, m in model.named_modules() if isinstance(m, PagedAttention)}
    loaded: set[str] = set()
    for stored, tensor in tensors:
        name = model_tensor_name(stored, renamed)  # errors name the tensor as the checkpoint stores it
        part = next((p for p in skipped if name.startswith(p)), None)
        if part is not None:
            skipped_counts[part] += 1
            continue
        if name.endswith(IGNORED_SUFFIXES + kv_quant.UNUSED_ATTENTION_SCALES) or name.startswith(unused) or \
                (tied_embeddings and name == "lm_head.weight"):
            continue
        if _load_kv_scale(attention_blocks, name, stored, tensor, source):
            continue
        want = expected.get(name)
        if want is not None and shape_of(tensor) != want:
            # A rank's slice of a wrong-sized tensor can still fit its parameter: checked whole, on every rank.
            raise ValueError(f"{source}: tensor {stored!r} has shape {shape_of(tensor)}, but the model's config makes "
                             f"it {want}")
        target, shard_id = own_names(name) or _resolve(name, packed)
        if target in folded:  # a module merged into another after the first load (layers/moe_shared.py)
            target, shard_ids = folded[target]
            shard_id = shard_ids[shard_id]
        param = params.get(target)
        if param is None:
            raise ValueError(f"{source} has a tensor {stored!r} with no place in the model (looked for {target!r})")
        try:
            getattr(param, "weight_loader", load_whole)(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"{source}: tensor {stored!r} (into {target!r}): {e}") from None
        loaded.add(target)
    # A packed layer's scales come with its weight (layers/quantization/packed.py).
    filled_with_weight = {f"{name}.{part}" for name, m in model.named_modules() if getattr(m, "packed", None) is not None
                          and f"{name}.weight" in loaded for part in PACKED_PARTS}
    # Packed experts' scales come with their weights (layers/moe_packed.py).
    filled_with_weight |= {f"{name}.{part}" for name, m in model.named_modules()
                           for weight, parts in getattr(getattr(m, "packed", None), "parts_with", {}).items()
                           if f"{name}.{weight}" in loaded for part in parts}
    missing = {n for n in params if n not in loaded and n not in filled_with_weight
               and not (tied_embeddings and n == "lm_head.weight")}
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        for part, count in skipped_counts.items():
            if count:
                logger.info("%s: left %d tensors of %s (%s*) unread: shardserve serves the text model", source,
                            count, skipped[part], part)


def _load_kv_scale(attention_blocks: dict[str, PagedAttention], name: str, stored: str, tensor, source: str) -> bool:
    """Set the KV scale that tensor `name` holds on its attention block's PagedAttention; False where `name` is no
    KV scale (attention/kv_quant.scale_target)."""
    target = kv_quant.scale_target(name)
    if target is None:
        return False
    block, kind = target
    attn = attention_blocks.get(block)
    if attn is None:
        raise ValueError(f"{source} has a KV scale {stored!r} outside any attention block of the model (looked for "
                         f"{block!r})")
    try:
        attn.set_kv_scale(kind, kv_quant.scale_value(stored, tensor))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return True


def model_tensor_name(name: str, renamed: dict[str, str]) -> str:
    """A checkpoint tensor's name as the model knows it: with the first of `renamed`'s checkpoint prefixes it
    starts with replaced by the model's."""
    for prefix, own in renamed.items():
        if name.startswith(prefix):
            return own + name[len(prefix):]
    return name


def load_synthetic_weights(model: nn.Module, model_config: ModelConfig, device: torch.device | str,
                           dtype: torch.dtype, seed: int = 0) -> None:
    """Fill `model` (this rank's shards) with synthetic weights, as `load_weights` does from a checkpoint."""
    load_tensors(model, iter_synthetic_checkpoint(model_config, device, dtype, seed),
                 model_config.tie_word_embeddings, f"synthetic weights for {model_config.architecture}")


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    config = getattr(model, "config", None)
    if config is None:
        return {}
    return expected_checkpoint_shapes(config)


def _resolve(name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    for part, (fused, shard_id) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None
