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

from shardserve.config import ModelConfig
from shardserve.weights.gguf_loader import (
    GGUFArray,
    count_gguf_tensors,
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
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
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
    """transformers' own load of the GGUF file (tens of seconds: loaded once a session, shared with the tests
    that compare tokens with it)."""
    pytest.importorskip("accelerate")
    from tests.helpers.reference import transformers_model

    path = Path(smollm2_gguf)
    return transformers_model(str(path.parent), path.name)


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


# HF tensor name (under model.layers.{i}.) -> GGUF name (under blk.{i}.), as llama.cpp's converter writes them.
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight":
    "ffn_up_shexp.weight", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}  # fmt: skip


def _moe_gguf(model, arch: str, path: Path, tokenizer: dict[str, Any] | None = None) -> None:
    """A transformers MoE model written as llama.cpp does: merged expert tensors, q/k rows permuted for llama;
    `tokenizer`: tokenizer.* metadata to write with it."""
    cfg = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state.pop("model.embed_tokens.weight"),
               "output_norm.weight": state.pop("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state.pop("lm_head.weight")
    state.pop("lm_head.weight", None)
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        gate_up = state.pop(prefix + "mlp.experts.gate_up_proj")  # [E, 2I, H]: gate rows, then up rows
        inter = gate_up.shape[1] // 2
        tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :inter]
        tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, inter:]
        tensors[f"blk.{i}.ffn_down_exps.weight"] = state.pop(prefix + "mlp.experts.down_proj")
        for hf_name, gguf_name in _GGUF_LAYER_NAMES.items():
            if prefix + hf_name in state:
                tensors[f"blk.{i}.{gguf_name}"] = state.pop(prefix + hf_name)
        if prefix + "mlp.shared_expert_gate.weight" in state:  # [1, H], a vector in llama.cpp's files
            tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"] = state.pop(prefix + "mlp.shared_expert_gate.weight")[0]
        if arch == "llama":
            for name, heads in (("attn_q.weight", cfg.num_attention_heads), ("attn_k.weight", cfg.num_key_value_heads)):
                tensors[f"blk.{i}.{name}"] = _llama_cpp_permute(tensors[f"blk.{i}.{name}"], heads)
    assert not state, f"tensors left unwritten: {sorted(state)}"
    metadata = {
        f"{arch}.block_count": cfg.num_hidden_layers, f"{arch}.context_length": 512,
        f"{arch}.embedding_length": cfg.hidden_size, f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.attention.key_length": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{arch}.expert_used_count": cfg.num_experts_per_tok,
    }  # fmt: skip
    if arch == "llama":
        metadata |= {"llama.expert_count": cfg.num_local_experts, "llama.feed_forward_length": cfg.intermediate_size}
    else:
        metadata |= {f"{arch}.expert_count": cfg.num_experts,
                     f"{arch}.expert_feed_forward_length": cfg.moe_intermediate_size,
                     f"{arch}.expert_weights_norm": int(cfg.norm_topk_prob)}
    if arch == "qwen2moe":
        metadata |= {"qwen2moe.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size}
    metadata |= tokenizer or {}
    _write_gguf(path, arch, metadata, {name: (np.ascontiguousarray(v), QType.F32) for name, v in tensors.items()})


def _all_layers_sparse(name: str, path: Path, **config: Any) -> str:
    """A tiny MoE of MOE_SPECS[name] without dense layers (llama.cpp's qwen2moe and qwen3moe have none)."""
    import dataclasses

    from tests.tiny_models import MOE_SPECS, make_tiny_model

    spec = MOE_SPECS[name]
    extra = {"mlp_only_layers": []} if "mlp_only_layers" in spec.config else {}
    return make_tiny_model(dataclasses.replace(spec, config={**spec.config, **extra, **config}), str(path))


@pytest.mark.parametrize("name, arch", [("mixtral", "llama"), ("qwen3-moe", "qwen3moe"), ("qwen2-moe", "qwen2moe")])
def test_a_mixture_of_experts_gguf_is_served_at_two_ranks_with_transformers_tokens(smollm2_gguf, tmp_path: Path,
                                                                                    name: str, arch: str):
    """The engine end to end on a GGUF mixture of experts (SmolLM2's tokenizer, so a vocabulary of 49,152):
    greedy tokens at TP 2 equal transformers float32 on the checkpoint the file was written from."""
    import transformers

    from tests.helpers.greedy import check_matches, reference

    reader = gguf.GGUFReader(smollm2_gguf)
    tokenizer = {f.name: f.contents() for f in reader.fields.values() if f.name.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    model_dir = _all_layers_sparse(name, tmp_path / name, vocab_size=vocab)
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path = tmp_path / f"{name}.gguf"
    _moe_gguf(original, arch, path, tokenizer)
    check_matches(str(path), f"{name} GGUF", 2, device="cpu", expected=reference(model_dir))


@pytest.mark.parametrize("name, arch", [("mixtral", "llama"), ("qwen3-moe-odd", "qwen3moe"), ("qwen2-moe", "qwen2moe")])
def test_a_mixture_of_experts_from_gguf_rebuilds_the_model(tiny_model_dir, tmp_path: Path, name: str, arch: str):
    """Mixtral (llama with experts), Qwen3-MoE and Qwen2-MoE (a shared expert and its gate) with merged expert
    tensors: the config says what the checkpoint's does, each expert comes out as its own tensors, and
    transformers built from them computes the same logits as the original."""
    import transformers

    model_dir = _all_layers_sparse(name, tmp_path / name) if name == "qwen2-moe" else tiny_model_dir(name)
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path = tmp_path / f"{name}.gguf"
    _moe_gguf(original, arch, path)

    config = read_gguf_config(str(path))
    assert config["architectures"] == original.config.architectures
    got, want = ModelConfig.from_hf_dict(config), ModelConfig.from_hf_dict(original.config.to_dict())
    moe_fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "renormalize_topk", "moe_layers",
                  "shared_expert_intermediate_size", "qkv_bias")
    assert [getattr(got, f) for f in moe_fields] == [getattr(want, f) for f in moe_fields]
    assert got.num_experts == 4 and got.moe_layers == tuple(range(config["num_hidden_layers"]))

    tensors = dict(iter_gguf_tensors(str(path)))
    assert count_gguf_tensors(str(path)) == len(tensors)
    num_experts = got.num_experts
    assert f"model.layers.0.mlp.experts.{num_experts - 1}.down_proj.weight" in tensors
    for i in range(config["num_hidden_layers"]):  # transformers keeps the experts of a layer in two tensors
        per_expert = {part: torch.stack([tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{part}.weight")
                                         for e in range(num_experts)])
                      for part in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
            (per_expert["gate_proj"], per_expert["up_proj"]), dim=1)
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = per_expert["down_proj"]
    rebuilt = getattr(transformers, config["architectures"][0])(transformers.AutoConfig.for_model(**config))
    rebuilt.load_state_dict(tensors, strict=not original.config.tie_word_embeddings)  # tied: no lm_head tensor
    if original.config.tie_word_embeddings:
        rebuilt.tie_weights()
    input_ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt.eval()(input_ids).logits, original(input_ids).logits)
