"""Qwen3.5 through the real engine: the MoE and dense text models, and the text model of an image-text checkpoint,
give transformers' float32 greedy tokens (its torch fallback of the Gated DeltaNet kernels) at TP 1, 2 and 3 with
prompts longer than a step's token budget prefilled in chunks; the planner counts the weights each rank builds.

The tiny checkpoints (tests/tiny_models.QWEN3_5_SPECS) store Gated DeltaNet's projections apart (in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a) and shard differently at each TP size: qwen3.5-moe's 3 key heads split at TP 3
and stay whole at TP 2, where its 4 attention heads split; qwen3.5's 5 query heads split at neither, its 2 key
heads at TP 2.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from tests.helpers.state_models import assert_all_returned, cpu_llm, greedy
from tests.models.reference import random_prompts, transformers_greedy

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 40, 1)
CHUNK = 16  # max_num_batched_tokens: the 17- and 40-token prompts are prefilled in chunks


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def _reference(model_dir: str, image_text: bool = False) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy tokens for each prompt alone."""
    return transformers_greedy(model_dir, tuple(map(tuple, _prompts())), NEW_TOKENS, image_text)


def _generate_in_chunks(model_dir: str, tp: int) -> list[tuple[int, ...]]:
    """The four prompts in one batch, prefilled in chunks of at most CHUNK tokens beside the others' decode
    steps; every KV block and state slot is back at the end."""
    with cpu_llm(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=CHUNK) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    return [tuple(o.token_ids) for o in outputs]


@pytest.mark.parametrize("name, tp", [("qwen3.5-moe", 1), ("qwen3.5-moe", 2), ("qwen3.5-moe", 3),
                                      ("qwen3.5", 1), ("qwen3.5", 2), ("qwen3.5", 3)])
def test_prompts_together_in_chunks_equal_transformers(tiny_model_dir, name, tp):
    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    got = _generate_in_chunks(model_dir, tp)
    for prompt, out, ref in zip(_prompts(), got, expected):
        assert out == ref, f"{name} TP={tp}, prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("name, architecture", [("qwen3.5-moe-vl", "Qwen3_5MoeForConditionalGeneration"),
                                                ("qwen3.5-vl", "Qwen3_5ForConditionalGeneration")])
def test_an_image_text_checkpoint_serves_its_text_model(tiny_model_dir, caplog, name, architecture):
    """...ForConditionalGeneration: config.json's text_config, the text model's tensors under
    model.language_model., the vision tower's under model.visual. left unread with one log line. Text-only
    prompts give the tokens of transformers' image-text model."""
    model_dir = tiny_model_dir(name)
    with open(os.path.join(model_dir, "config.json")) as f:
        assert json.load(f)["architectures"] == [architecture]
    expected = _reference(model_dir, image_text=True)
    with caplog.at_level(logging.INFO, logger="shardserve.weights.loader"):
        got = _generate_in_chunks(model_dir, 1)
    assert tuple(got) == expected
    skipped = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(skipped) == 1 and "left 21 tensors of the vision tower (model.visual.*) unread" in skipped[0]


def test_an_image_text_checkpoint_must_hold_every_text_tensor(tiny_model_dir):
    """The text model's tensors are checked as a text checkpoint's are: one missing is named, one of the wrong
    shape (a Gated DeltaNet projection stored apart) or with no place in the model is refused, by its stored
    name."""
    from safetensors.torch import load_file

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models.qwen3_5 import Qwen3_5MoeForConditionalGeneration
    from shardserve.weights.loader import load_tensors

    model_dir = tiny_model_dir("qwen3.5-moe-vl")
    cfg = ModelConfig.from_model_path(model_dir)
    model = Qwen3_5MoeForConditionalGeneration(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    load_tensors(model, tensors.items(), False, "whole")
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.norm.weight'\]"):
        load_tensors(model, [(n, t) for n, t in tensors.items() if n != "model.language_model.norm.weight"], False,
                     "one short")
    wrong = "model.language_model.layers.0.linear_attn.in_proj_b.weight"
    with pytest.raises(ValueError, match=f"tensor '{wrong}' has shape \\(5, 64\\), but the model's config makes "
                                         f"it \\(6, 64\\)"):
        load_tensors(model, {**tensors, wrong: torch.zeros(5, 64)}.items(), False, "one misshapen")
    with pytest.raises(ValueError, match="'model.language_model.extra.weight' with no place in the model"):
        load_tensors(model, [*tensors.items(), ("model.language_model.extra.weight", torch.zeros(2))], False,
                     "one over")


@pytest.mark.parametrize("name", ["qwen3.5-moe", "qwen3.5", "qwen3.5-moe-vl", "qwen3.5-vl"])
def test_the_planner_counts_the_weights_a_rank_holds(tiny_model_dir, name):
    """The memory planner's weights per rank (from config.json, an image-text checkpoint's text_config) are what
    rank 0 builds at TP 1, 2 and 3, where some blocks split and others are whole on every rank."""
    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models import model_class
    from shardserve.planner import load_hf_config, weight_elements_per_rank

    model_dir = tiny_model_dir(name)
    cfg = ModelConfig.from_model_path(model_dir)
    for tp in (1, 2, 3):
        model = model_class(cfg.architecture)(cfg, Communicator(None, 0, tp), torch.float32, max_positions=64)
        assert weight_elements_per_rank(load_hf_config(model_dir), tp, []) == \
            sum(p.numel() for p in model.parameters()), f"TP={tp}"


def test_the_shared_expert_is_one_more_expert_with_the_same_tokens(tiny_model_dir, set_env):
    """Qwen3.5-MoE's shared expert has its experts' size, so each block computes it as expert E with the router's
    row E as its gate (layers/moe_shared.py); with SHARDSERVE_FOLD_SHARED_EXPERT=0 the same tokens come from the
    shared expert apart."""
    model_dir = tiny_model_dir("qwen3.5-moe")
    outputs = []
    for fold in ("1", "0"):
        set_env(SHARDSERVE_FOLD_SHARED_EXPERT=fold)
        with cpu_llm(model_dir) as llm:
            blocks = [m for m in llm.engine.runner.model.modules() if hasattr(m, "shared_folded")]
            assert len(blocks) == 4
            assert all(m.shared_folded == (fold == "1") and (m.shared_expert is None) == (fold == "1") for m in blocks)
            outputs.append([o.token_ids for o in llm.generate(_prompts(), greedy(NEW_TOKENS))])
    assert outputs[0] == outputs[1] == [list(t) for t in _reference(model_dir)]


def test_a_second_load_into_a_folded_model_refills_the_shared_experts_slot(tiny_model_dir):
    """A later load into the same model (a wake from sleep level 2 in place) finds the shared expert's and its
    gate's tensors in expert E's slot and the router's row E."""
    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.layers.moe_shared import fold_shared_experts
    from shardserve.models import model_class
    from shardserve.weights.loader import load_weights

    model_dir = tiny_model_dir("qwen3.5-moe")
    cfg = ModelConfig.from_model_path(model_dir)
    model = model_class(cfg.architecture)(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    load_weights(model, model_dir, tied_embeddings=False)
    assert fold_shared_experts(model) == 4
    blocks = [m for m in model.modules() if getattr(m, "shared_folded", False)]
    folded = [(m.w13.clone(), m.w2.clone(), m.gate.weight.clone()) for m in blocks]
    assert all(g.shape[0] == 5 and w13.shape[0] == 5 for w13, _, g in folded)
    for m in blocks:
        m.w13.data.zero_(), m.w2.data.zero_(), m.gate.weight.data.zero_()
    load_weights(model, model_dir, tied_embeddings=False)
    for m, (w13, w2, gate) in zip(blocks, folded):
        assert torch.equal(m.w13, w13) and torch.equal(m.w2, w2) and torch.equal(m.gate.weight, gate)


def _folded_block_output(model_dir: str, rank: int, tp: int, x: torch.Tensor, corrupt: bool = False):
    """Rank `rank` of `tp`'s share of layer 0's sparse block (shared expert folded) on x: a partial sum where the
    block is split. `corrupt`: this rank's rows of the folded shared expert (slot E) are perturbed after loading."""
    from shardserve.config import ModelConfig
    from shardserve.layers.moe_shared import fold_shared_experts
    from shardserve.models import model_class
    from shardserve.weights.loader import load_weights
    from tests.helpers.partial_sums import PartialSums

    cfg = ModelConfig.from_model_path(model_dir)
    model = model_class(cfg.architecture)(cfg, PartialSums(rank, tp), torch.float32, max_positions=64)
    load_weights(model, model_dir, tied_embeddings=False)
    assert fold_shared_experts(model, log=False) == 4
    layer = model.model.layers[0]
    if corrupt:
        layer.mlp.w13.data[-1].mul_(1.5)
    with torch.no_grad():
        out, _ = layer.mlp(x, None, layer.post_attention_layernorm)
    return out


def test_a_wrong_slice_of_the_folded_shared_expert_on_one_rank_fails_the_comparison(tiny_model_dir):
    """The folded shared expert holds each rank's rows of the shared expert in the experts' last slot: the two
    ranks' shares sum to the whole block's output, and a perturbed slot on rank 1 makes them differ."""
    model_dir = tiny_model_dir("qwen3.5-moe")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    whole = _folded_block_output(model_dir, 0, 1, x)
    shares = [_folded_block_output(model_dir, rank, 2, x) for rank in (0, 1)]
    torch.testing.assert_close(shares[0] + shares[1], whole, atol=1e-5, rtol=1e-5)
    wrong = _folded_block_output(model_dir, 1, 2, x, corrupt=True)
    assert (shares[0] + wrong - whole).abs().max() > 1e-3
