"""After loading, ranks whose replicated weights differ (a corrupted or different checkpoint on one
node) refuse to serve, naming the rank and the tensors; identical ones start."""

from __future__ import annotations

import torch

from tests.ranks import run_ranks, start_model_runner

CORRUPTED = "model.layers.1.post_attention_layernorm.weight"


def _rank(rank: int, port: int, model_dir: str, corrupt_rank: int | None, results, corrupted: str = CORRUPTED) -> None:
    import shardserve.engine.model_runner as model_runner

    if rank == corrupt_rank:
        original = model_runner.load_weights

        def load_then_corrupt(model, *args, **kwargs):
            original(model, *args, **kwargs)
            with torch.no_grad():
                model.get_parameter(corrupted).add_(1e-3)

        model_runner.load_weights = load_then_corrupt
    start_model_runner(rank, port, model_dir, results, "test-token")


def test_a_corrupted_norm_on_one_rank_stops_start_up_naming_rank_and_tensor(tiny_model_dir):
    outcome = run_ranks(_rank, 2, tiny_model_dir("llama-untied"), 1)
    for rank in (0, 1):
        assert outcome[rank].startswith("StartupMismatch: the replicated weights are not the same"), outcome[rank]
        assert "rank 1 (" in outcome[rank] and "differs from rank 0 (" in outcome[rank]
        assert "in 1 of " in outcome[rank] and CORRUPTED in outcome[rank]


def test_identical_weights_start(tiny_model_dir):
    assert run_ranks(_rank, 2, tiny_model_dir("qwen3"), None) == {0: "started", 1: "started"}


def _rank_with_packed_layer(rank: int, port: int, model_dir: str, corrupt_rank: int, results) -> None:
    _rank(rank, port, model_dir, corrupt_rank, results, corrupted=PACKED)


PACKED = "model.layers.0.self_attn.qkv_proj.weight"


def test_a_replicated_linear_layer_counts_even_once_its_kernel_packed_it(tiny_model_dir):
    """5 attention heads do not split over 2 ranks: the attention block is replicated, and its weights, re-laid
    out for the CPU kernel after loading, must still be the same on both ranks."""
    outcome = run_ranks(_rank_with_packed_layer, 2, tiny_model_dir("llama-odd-bfloat16"), 1)
    for rank in (0, 1):
        assert outcome[rank].startswith("StartupMismatch: the replicated weights are not the same"), outcome[rank]
        assert "in 1 of " in outcome[rank] and PACKED in outcome[rank]
