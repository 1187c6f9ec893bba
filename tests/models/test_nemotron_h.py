"""NemotronH through the real engine: greedy tokens equal transformers' float32 generate (its torch fallback of the
Mamba-2 kernels) with prompts in one step or in chunks that cut inside an SSD chunk, alone or together, at TP 1 and
2; the state slots go back (the mixture-of-experts layers: test_nemotron_h_moe.py)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.configs import config_with
from tests.helpers.state_models import assert_all_returned, cpu_llm, greedy
from tests.models.reference import random_prompts, transformers_greedy

NEW_TOKENS = 8
PROMPT_LENGTHS = (5, 17, 40, 1)


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def _reference(model_dir: str) -> tuple[tuple[int, ...], ...]:
    return transformers_greedy(model_dir, tuple(map(tuple, _prompts())), NEW_TOKENS)


@pytest.mark.parametrize("name, tp", [("nemotron-h", 1), ("nemotron-h", 2), ("nemotron-h-groups", 2),
                                      ("nemotron-h-odd", 1), ("nemotron-h-odd", 2)])
def test_prompts_together_in_chunks_equal_transformers(tiny_model_dir, name, tp):
    """All four prompts in one batch, the 17- and 40-token ones prefilled in chunks of at most 12 tokens (cuts
    inside the SSD chunks of 16 and 8) beside the others' decode steps. At TP 2 "nemotron-h" splits its Mamba-2
    layers a B/C group per rank, "nemotron-h-groups" two groups of two heads a rank (as Nemotron-3-Nano's eight
    groups split); "nemotron-h-odd" (one group, 5 heads) keeps them whole on both ranks."""
    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    with cpu_llm(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=12) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    for prompt, out, ref in zip(_prompts(), outputs, expected):
        assert tuple(out.token_ids) == ref, f"{name} TP={tp}, prompt of {len(prompt)} tokens"


def test_each_prompt_alone_in_one_step_equals_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("nemotron-h")
    expected = _reference(model_dir)
    with cpu_llm(model_dir) as llm:
        got = [tuple(llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids) for prompt in _prompts()]
        assert_all_returned(llm)
    assert tuple(got) == expected


def test_the_layers_are_what_the_config_says(tiny_model_dir):
    """Mamba-2 layers hold state pools, the attention layer the KV cache, the MLP blocks neither."""
    from shardserve.config import ModelConfig

    cfg = ModelConfig.from_model_path(tiny_model_dir("nemotron-h"))
    assert cfg.architecture == "NemotronHForCausalLM"
    assert cfg.linear_attention_layers == (0, 3) and cfg.kv_layers == (2,)
    assert cfg.mlp_activation == "relu2" and not cfg.rope and cfg.mamba_n_groups == 2


def test_the_older_pattern_names_the_same_layers(tiny_model_dir, tmp_path):
    from shardserve.config import ModelConfig

    model_dir = tiny_model_dir("nemotron-h")
    path = config_with(model_dir, tmp_path, layers_block_type=None, hybrid_override_pattern="M-*M-")
    assert ModelConfig.from_model_path(path).layer_types == ModelConfig.from_model_path(model_dir).layer_types


def test_a_multi_token_prediction_layer_is_skipped(tiny_model_dir, caplog):
    """Released checkpoints carry `mtp.` layers (speculative decoding, not served): left unread with one log line."""
    import logging

    from safetensors.torch import load_file

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models.nemotron_h import NemotronHForCausalLM
    from shardserve.weights.loader import load_tensors

    model_dir = tiny_model_dir("nemotron-h")
    cfg = ModelConfig.from_model_path(model_dir)
    model = NemotronHForCausalLM(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    extra = {"mtp.layers.0.norm.weight": torch.zeros(cfg.hidden_size)}
    with caplog.at_level(logging.INFO, logger="shardserve.weights.loader"):
        load_tensors(model, [*tensors.items(), *extra.items()], False, "a checkpoint with an mtp layer")
    assert any("multi-token-prediction" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_tensors(model, [(n, t) for n, t in tensors.items() if n != "backbone.norm_f.weight"], False, "short")


def test_preempted_sequences_recompute_from_an_empty_state(tiny_model_dir):
    """A KV cache too small for four sequences that grow to 52 tokens (4 blocks each): later arrivals are preempted
    and recomputed, their Mamba-2 states started again from zero, and still give the tokens they give alone."""
    model_dir = tiny_model_dir("nemotron-h")
    prompts = [p for p in _prompts() if len(p) == 40] + [list(range(100 + i, 140 + i)) for i in range(3)]
    with cpu_llm(model_dir, kv_cache_memory_gb=0.00006, max_model_len=64) as llm:
        assert llm.engine.block_manager.num_blocks < 16
        outputs = llm.generate(prompts, greedy(12))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_returned(llm)
    assert tuple(outputs[0].token_ids[:NEW_TOKENS]) == _reference(model_dir)[PROMPT_LENGTHS.index(40)]
    with cpu_llm(model_dir, max_model_len=64) as llm:
        alone = [tuple(llm.generate([p], greedy(12))[0].token_ids) for p in prompts[1:]]
    assert [tuple(o.token_ids) for o in outputs[1:]] == alone


def test_an_aborted_request_gives_its_slot_back(tiny_model_dir):
    model_dir = tiny_model_dir("nemotron-h")
    prompts = _prompts()
    with cpu_llm(model_dir) as llm:
        engine = llm.engine
        engine.add_request("stays", prompts[1], greedy(NEW_TOKENS))
        engine.add_request("aborted", prompts[2], greedy(max_tokens=100))
        outputs = engine.step() + engine.step()
        engine.abort("aborted")
        assert len(engine.scheduler.free_slots) == engine.config.max_num_seqs - 1
        while engine.has_work():
            outputs += engine.step()
        assert_all_returned(llm)
    tokens = [t for out in outputs if out.request_id == "stays" for t in out.new_token_ids]
    assert tuple(tokens) == _reference(model_dir)[1]


def test_after_sleep_and_wake_the_states_start_empty(tiny_model_dir):
    model_dir = tiny_model_dir("nemotron-h")
    with cpu_llm(model_dir) as llm:
        llm.generate([_prompts()[0]], greedy(NEW_TOKENS))
        llm.sleep(1)
        assert llm.engine.runner.state_pools == {}
        llm.wake_up()
        got = llm.generate([_prompts()[1]], greedy(NEW_TOKENS))[0].token_ids
        assert_all_returned(llm)
    assert tuple(got) == _reference(model_dir)[1]
