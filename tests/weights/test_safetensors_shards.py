"""Each rank's parameters are exactly its slice of the checkpoint, read through safetensors slices."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.models.llama import LlamaForCausalLM
from shardserve.weights import loader
from shardserve.weights.loader import load_weights, safetensors_files


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _rank_model(model_dir: str, rank: int, world: int) -> LlamaForCausalLM:
    cfg = ModelConfig.from_model_path(model_dir)
    # Building and loading issue no collectives, so a rank can be examined on its own.
    model = LlamaForCausalLM(cfg, Communicator(None, rank, world), torch.float32, max_positions=64)
    load_weights(model, model_dir, cfg.tie_word_embeddings)
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_holds_exactly_its_slices(tiny_model_dir, rank):
    model_dir = tiny_model_dir("llama-untied")  # 8 heads over 2 KV heads, intermediate 256, vocab 1000
    full = _checkpoint(model_dir)
    model = _rank_model(model_dir, rank, 2)
    layer = model.model.layers[1]
    hd = 16
    q = full["model.layers.1.self_attn.q_proj.weight"][rank * 4 * hd:(rank + 1) * 4 * hd]
    k = full["model.layers.1.self_attn.k_proj.weight"][rank * hd:(rank + 1) * hd]  # one KV head each
    v = full["model.layers.1.self_attn.v_proj.weight"][rank * hd:(rank + 1) * hd]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]))
    o = full["model.layers.1.self_attn.o_proj.weight"][:, rank * 4 * hd:(rank + 1) * 4 * hd]
    assert torch.equal(layer.self_attn.o_proj.weight, o)
    gate = full["model.layers.1.mlp.gate_proj.weight"][rank * 128:(rank + 1) * 128]
    up = full["model.layers.1.mlp.up_proj.weight"][rank * 128:(rank + 1) * 128]
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]))
    down = full["model.layers.1.mlp.down_proj.weight"][:, rank * 128:(rank + 1) * 128]
    assert torch.equal(layer.mlp.down_proj.weight, down)
    head = full["lm_head.weight"][rank * 500:(rank + 1) * 500]
    assert torch.equal(model.lm_head.weight, head)


def test_rank_reads_only_its_share_of_the_bytes(tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama-untied")
    full_bytes = sum(t.numel() * t.element_size() for t in _checkpoint(model_dir).values())
    read = {"bytes": 0}
    real_iter = loader.iter_checkpoint

    class CountingSlice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            tensor = self.inner[index]
            read["bytes"] += tensor.numel() * tensor.element_size()
            return tensor

    def counting_iter(path, quantization=None):
        for name, tensor_slice in real_iter(path, quantization):
            yield name, CountingSlice(tensor_slice)

    monkeypatch.setattr(loader, "iter_checkpoint", counting_iter)
    _rank_model(model_dir, 1, 2)
    # Norms are replicated (tiny), everything else is halved: well under 60% of the checkpoint.
    assert read["bytes"] < 0.6 * full_bytes, f"rank read {read['bytes']} of {full_bytes} bytes"


def test_uneven_vocab_is_padded_and_cut(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")  # vocab 1000 over 3 ranks: 334 rows each, the last padded
    full = _checkpoint(model_dir)["model.embed_tokens.weight"]
    last = _rank_model(model_dir, 2, 3)
    rows = last.model.embed_tokens.weight
    assert rows.shape[0] == 334
    assert torch.equal(rows[:332], full[668:])
    assert torch.count_nonzero(rows[332:]) == 0


@pytest.mark.parametrize("tensor, shape", [("model.layers.0.self_attn.o_proj.weight", (128, 120)),
                                           ("model.layers.0.self_attn.o_proj.weight", (128, 136)),
                                           ("model.layers.0.self_attn.q_proj.weight", (136, 128)),
                                           ("model.layers.0.mlp.up_proj.weight", (256, 1)),
                                           ("model.embed_tokens.weight", (1000, 1))])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_of_the_wrong_shape_is_refused_by_name_on_every_rank(tiny_model_dir, tmp_path, tensor, shape,
                                                                       rank):
    """A column of one value would broadcast over a layer's rows; a narrower or wider matrix would leave part of
    a layer unread or fill it from the wrong columns, while each rank's slice still fits its parameter."""
    import shutil

    from safetensors.torch import save_file

    model_dir = tmp_path / "wrong"
    shutil.copytree(tiny_model_dir("llama-untied"), model_dir)
    tensors = _checkpoint(str(model_dir))
    for path in safetensors_files(str(model_dir)):
        path_obj = model_dir / path.rsplit("/", 1)[-1]
        path_obj.unlink()
    (model_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    tensors[tensor] = torch.randn(shape)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError) as e:
        _rank_model(str(model_dir), rank, 2)
    assert f"tensor {tensor!r} has shape {shape}" in str(e.value), str(e.value)
