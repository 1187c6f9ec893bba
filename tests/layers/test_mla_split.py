"""Multi-head latent attention split by heads over two ranks: each rank's q_b_proj and kv_b_proj hold its heads'
rows, the cache entry is the same on both, and the two ranks' head outputs side by side are the one-rank layer's,
for a prefill chunk (the expanded form) and the decode step after it (the absorbed form); a wrong slice of either
projection on one rank fails that comparison."""

from __future__ import annotations

import pytest
import torch

from shardserve.attention.batch import StepBatch
from shardserve.attention.mla import MlaBackend
from shardserve.config import CacheLayout, ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from shardserve.weights.loader import load_tensors
from shardserve.wire.step_plan import SeqChunk

BLOCK = 16
PROMPT = 21


def _head_outputs(model_dir: str, rank: int, world: int, corrupt: str | None = None) -> torch.Tensor:
    """Layer 0's attention (before o_proj) on rank `rank` of `world`: a 21-token prefill chunk, then one decode
    token, rows stacked; `corrupt`: a projection of rank 1 whose rows get a shift."""
    import os

    from safetensors.torch import load_file

    cfg = ModelConfig.from_model_path(model_dir)
    model = DeepseekV3ForCausalLM(cfg, Communicator(None, rank, world), torch.float32, max_positions=64)
    load_tensors(model, load_file(os.path.join(model_dir, "model.safetensors")).items(), False, "tiny DeepSeek")
    attn = model.model.layers[0].self_attn
    if corrupt is not None and rank == 1:
        getattr(attn, corrupt).weight.data[::3] += 0.5
    layout: CacheLayout = model.cache_layout()
    cache = torch.zeros(4 * BLOCK, layout.heads, layout.dim)
    backend = MlaBackend(torch.device("cpu"), BLOCK)
    h = torch.randn(PROMPT + 1, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = []
    for start, count in ((0, PROMPT), (PROMPT, 1)):
        batch = StepBatch.from_chunks([SeqChunk(0, start, list(range(count)), [1, 2], True)], BLOCK)
        positions = torch.tensor(batch.positions)
        outs.append(attn.attention(h[start:start + count], model.model.rotary.lookup(positions), cache,
                                   backend.build_metadata(batch)))
    return torch.cat(outs)


def test_two_ranks_heads_side_by_side_are_one_ranks(tiny_model_dir):
    model_dir = tiny_model_dir("deepseek-v3")
    whole = _head_outputs(model_dir, 0, 1)
    split = torch.cat([_head_outputs(model_dir, rank, 2) for rank in range(2)], dim=-1)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("corrupt", ["q_b_proj", "kv_b_proj"])
def test_a_wrong_slice_on_one_rank_fails_the_comparison(tiny_model_dir, corrupt):
    model_dir = tiny_model_dir("deepseek-v3")
    whole = _head_outputs(model_dir, 0, 1)
    split = torch.cat([_head_outputs(model_dir, rank, 2, corrupt) for rank in range(2)], dim=-1)
    assert not torch.allclose(split, whole, rtol=1e-3, atol=1e-3)
    heads = split.shape[-1] // 2
    torch.testing.assert_close(split[:, :heads], whole[:, :heads], rtol=1e-5, atol=1e-5)  # rank 0's heads unchanged


def test_a_graph_batch_pads_rows_that_store_and_read_nothing(tiny_model_dir):
    """A CUDA graph's decode metadata (static buffers, rows past the live batch with slot -1 and context 0): the
    live rows equal the same step's eager metadata, the padding rows' outputs are zeros, not NaN, and the cache
    holds nothing of theirs."""
    import os

    from safetensors.torch import load_file

    model_dir = tiny_model_dir("deepseek-v3")
    cfg = ModelConfig.from_model_path(model_dir)
    model = DeepseekV3ForCausalLM(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    load_tensors(model, load_file(os.path.join(model_dir, "model.safetensors")).items(), False, "tiny DeepSeek")
    attn, layout = model.model.layers[0].self_attn, model.cache_layout()
    backend = MlaBackend(torch.device("cpu"), BLOCK)
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(6 * BLOCK, layout.heads, layout.dim)
    cache[BLOCK:] = torch.randn(5 * BLOCK, layout.heads, layout.dim, generator=g)  # earlier tokens; block 0 zeroed
    # Two live sequences: 20 and 7 positions cached, each decoding one more token.
    batch = StepBatch.from_chunks([SeqChunk(0, 20, [5], [1, 2], True), SeqChunk(1, 7, [6], [3], True)], BLOCK)
    h = torch.randn(4, cfg.hidden_size, generator=g)
    positions = torch.tensor(batch.positions + [0, 0])

    eager_cache = cache.clone()
    eager = attn.attention(h[:2], model.model.rotary.lookup(positions[:2]), eager_cache, backend.build_metadata(batch))

    static = backend.static_decode_metadata(8, 4)
    meta = backend.graph_view(static, 4, 4 * BLOCK)
    meta.slot_mapping.copy_(torch.tensor(batch.slot_mapping + [-1, -1]))
    meta.decode_context_lens.copy_(torch.tensor([21, 8, 0, 0], dtype=torch.int32))
    meta.decode_block_tables[0, :2] = torch.tensor([1, 2], dtype=torch.int32)
    meta.decode_block_tables[1, :1] = 3
    graph_cache = cache.clone()
    graphed = attn.attention(h, model.model.rotary.lookup(positions), graph_cache, meta)

    torch.testing.assert_close(graphed[:2], eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed[2:], torch.zeros_like(graphed[2:]))
    torch.testing.assert_close(graph_cache, eager_cache, rtol=1e-5, atol=1e-5)
    live = torch.zeros(len(cache), dtype=torch.bool)
    live[batch.slot_mapping] = True
    assert torch.equal(graph_cache[~live], cache[~live])  # the padding rows stored nothing: slot 0 is still zeros
