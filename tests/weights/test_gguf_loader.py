"""GGUF loading: tiny files written with gguf's own writer, and the real SmolLM2 file checked
against transformers' GGUF loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from shardserve.weights.gguf_loader import (
    GGUFArray,
    hf_tensor_name,
    iter_gguf_tensors,
    read_gguf_config,
    read_gguf_header,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 96, 128
Q_DIM, KV_DIM = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
LAYER_0 = "model.layers.0."


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder q/k rows the way llama.cpp's converter does (HF half rotation -> adjacent pairs)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(
    path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, tuple[np.ndarray, QType]]
) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (values, qtype) in tensors.items():
        if qtype == QType.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_metadata(arch: str) -> dict[str, Any]:
    return {
        f"{arch}.block_count": 1,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 500000.0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


_RNG = np.random.default_rng(0)


def _random(*shape: int) -> np.ndarray:
    return _RNG.standard_normal(shape, dtype=np.float32)


def _round_trip(values: np.ndarray, qtype: QType) -> torch.Tensor:
    """What a tensor stored as qtype reads back as."""
    return torch.from_numpy(np.array(dequantize(quantize(values, qtype), qtype), dtype=np.float32))


def test_tiny_llama_tensors_are_renamed_dequantized_and_unpermuted(tmp_path: Path) -> None:
    q, k = _random(Q_DIM, HIDDEN), _random(KV_DIM, HIDDEN)
    cases = {  # GGUF name: (HF name, values, stored as)
        "token_embd.weight": ("model.embed_tokens.weight", _random(VOCAB, HIDDEN), QType.Q8_0),
        "blk.0.attn_v.weight": (LAYER_0 + "self_attn.v_proj.weight", _random(KV_DIM, HIDDEN), QType.F16),
        "blk.0.attn_output.weight": (LAYER_0 + "self_attn.o_proj.weight", _random(HIDDEN, Q_DIM), QType.BF16),
        "blk.0.ffn_gate.weight": (LAYER_0 + "mlp.gate_proj.weight", _random(FFN, HIDDEN), QType.Q4_1),
        "blk.0.ffn_up.weight": (LAYER_0 + "mlp.up_proj.weight", _random(FFN, HIDDEN), QType.Q4_1),
        "blk.0.ffn_down.weight": (LAYER_0 + "mlp.down_proj.weight", _random(HIDDEN, FFN), QType.Q4_1),
        "blk.0.attn_norm.weight": (LAYER_0 + "input_layernorm.weight", _random(HIDDEN), QType.F32),
        "blk.0.ffn_norm.weight": (LAYER_0 + "post_attention_layernorm.weight", _random(HIDDEN), QType.F32),
        "output_norm.weight": ("model.norm.weight", _random(HIDDEN), QType.F32),
        "output.weight": ("lm_head.weight", _random(VOCAB, HIDDEN), QType.Q8_0),
    }  # fmt: skip
    to_write = {gguf_name: (values, qtype) for gguf_name, (_, values, qtype) in cases.items()}
    to_write["blk.0.attn_q.weight"] = (_llama_cpp_permute(q, HEADS), QType.F32)
    to_write["blk.0.attn_k.weight"] = (_llama_cpp_permute(k, KV_HEADS), QType.F32)
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, "llama", _tiny_metadata("llama"), to_write)

    loaded = dict(iter_gguf_tensors(str(path)))

    assert torch.equal(loaded.pop("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(q))
    assert torch.equal(loaded.pop("model.layers.0.self_attn.k_proj.weight"), torch.from_numpy(k))
    assert loaded.keys() == {hf_name for hf_name, _, _ in cases.values()}
    for hf_name, values, qtype in cases.values():
        assert loaded[hf_name].dtype == torch.float32
        assert torch.equal(loaded[hf_name], _round_trip(values, qtype)), hf_name


def test_tiny_llama_config(tmp_path: Path) -> None:
    metadata = _tiny_metadata("llama") | {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 64,
    }
    tensors = {
        "token_embd.weight": (_random(VOCAB, HIDDEN), QType.F16),
        "output_norm.weight": (_random(HIDDEN), QType.F32),
    }
    path = tmp_path / "tiny-llama.gguf"
    _write_gguf(path, "llama", metadata, tensors)

    config = read_gguf_config(str(path))

    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": "float16",
        "gguf_quantized": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 64},
    }


def test_tiny_qwen3_keeps_row_order_and_maps_norms_and_biases(tmp_path: Path) -> None:
    q, k = _random(Q_DIM, HIDDEN), _random(KV_DIM, HIDDEN)
    q_bias, q_norm = _random(Q_DIM), _random(HEAD_DIM)
    tensors = {
        "token_embd.weight": (_random(VOCAB, HIDDEN), QType.F32),
        "blk.0.attn_q.weight": (q, QType.F32),
        "blk.0.attn_k.weight": (k, QType.F32),
        "blk.0.attn_q.bias": (q_bias, QType.F32),
        "blk.0.attn_q_norm.weight": (q_norm, QType.F32),
    }
    metadata = _tiny_metadata("qwen3") | {"qwen3.attention.key_length": 32}
    path = tmp_path / "tiny-qwen3.gguf"
    _write_gguf(path, "qwen3", metadata, tensors)

    loaded = dict(iter_gguf_tensors(str(path)))
    config = read_gguf_config(str(path))

    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(loaded["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(q_bias))
    assert torch.equal(loaded["model.layers.0.self_attn.q_norm.weight"], torch.from_numpy(q_norm))
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 32  # from key_length, not hidden_size / heads
    assert config["attention_bias"] and config["torch_dtype"] == "float32"


def test_unknown_tensor_and_architecture_are_rejected(tmp_path: Path) -> None:
    assert hf_tensor_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")
    path = tmp_path / "tiny-mamba.gguf"
    _write_gguf(path, "mamba", {}, {"token_embd.weight": (_random(VOCAB, HIDDEN), QType.F32)})
    with pytest.raises(ValueError, match="'mamba' is not supported"):
        read_gguf_config(str(path))


def test_header_skips_array_items_but_keeps_their_count(smollm2_gguf: str) -> None:
    header = read_gguf_header(smollm2_gguf)

    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["tokenizer.ggml.tokens"] == GGUFArray(gguf.GGUFValueType.STRING, 49152)
    assert header.metadata["tokenizer.ggml.eos_token_id"] == 2
    assert len(header.tensors) == 272 and header.data_offset % 32 == 0


# --- the real file against transformers' GGUF loader ---


@pytest.fixture(scope="module")
def reference_model(smollm2_gguf: str) -> torch.nn.Module:
    """transformers' own load of the GGUF file (tens of seconds: loaded once)."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = Path(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def loaded_tensors(smollm2_gguf: str) -> list[tuple[str, torch.Tensor]]:
    return list(iter_gguf_tensors(smollm2_gguf))


def test_tensors_match_transformers(
    loaded_tensors: list[tuple[str, torch.Tensor]], reference_model: torch.nn.Module
) -> None:
    reference = reference_model.state_dict()
    for name, tensor in loaded_tensors:
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference[name].shape, name
        # Both sides dequantize with gguf.quants, so the values match exactly.
        assert torch.equal(tensor, reference[name]), name

    names = [name for name, _ in loaded_tensors]
    assert len(names) == len(set(names))
    # The file has no output.weight: lm_head is tied to the embedding.
    assert set(names) == set(reference) - {"lm_head.weight"}


def test_config_matches_transformers(smollm2_gguf: str, reference_model: torch.nn.Module) -> None:
    config = read_gguf_config(smollm2_gguf)
    expected = reference_model.config

    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type",
    ):  # fmt: skip
        assert config[key] == getattr(expected, key), key
    assert config["rms_norm_eps"] == pytest.approx(expected.rms_norm_eps)
    assert config["rope_theta"] == expected.rope_parameters["rope_theta"]
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "bfloat16"
    assert config["gguf_quantized"] is True  # Q4_1: exact in float32 only


def test_config_and_tensors_rebuild_the_reference_model(
    smollm2_gguf: str, loaded_tensors: list[tuple[str, torch.Tensor]], reference_model: torch.nn.Module
) -> None:
    import transformers

    config = read_gguf_config(smollm2_gguf)
    model_class = getattr(transformers, config["architectures"][0])
    model, loading_info = model_class.from_pretrained(
        None,
        config=transformers.AutoConfig.for_model(**config),
        state_dict=dict(loaded_tensors),
        dtype=torch.float32,
        output_loading_info=True,
    )
    input_ids = torch.arange(1, 33).unsqueeze(0)

    with torch.no_grad():
        logits, expected_logits = model.eval()(input_ids).logits, reference_model(input_ids).logits

    assert not loading_info["missing_keys"] and not loading_info["unexpected_keys"]
    torch.testing.assert_close(logits, expected_logits)
