"""Qwen3-Next through the real engine: greedy tokens equal transformers' float32 generate (its torch fallback of
the Gated DeltaNet kernels) with prompts in one step or in chunks, alone or together; the recurrent-state slots go
back on finish, abort and preemption; prefix caching is off for the model."""

from __future__ import annotations

import logging

import pytest
import torch

from shardserve.entrypoints.llm import LLM
from tests.helpers.state_models import assert_all_returned, cpu_llm, greedy, greedy_choices_over_http
from tests.models.reference import random_prompts, transformers_greedy

NAME = "qwen3-next"
# The engine's state-slot behaviours, on Qwen3-Next and on Qwen3.5-MoE (Gated DeltaNet's projections stored apart).
FAMILIES = (NAME, "qwen3.5-moe")
# A KV-cache budget that leaves 7 blocks of 16 tokens once the four sequences' state pools are taken from it.
SEVEN_BLOCKS_GB = {NAME: 0.0001, "qwen3.5-moe": 0.00012}
NEW_TOKENS = 10
PROMPT_LENGTHS = (5, 17, 40, 1)


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS)


def _reference(model_dir: str) -> tuple[tuple[int, ...], ...]:
    """transformers' greedy tokens for each prompt alone."""
    return transformers_greedy(model_dir, tuple(map(tuple, _prompts())), NEW_TOKENS)


@pytest.mark.parametrize("name, tp", [(NAME, 1), (NAME, 2), (NAME, 3), ("qwen3-next-odd", 2)])
def test_prompts_together_in_chunks_equal_transformers(tiny_model_dir, name, tp):
    """All four prompts in one batch, the 17- and 40-token ones prefilled in chunks of at most 16 tokens beside the
    others' decode steps: each sequence's state is carried across its chunks in its own slot. At two ranks each
    rank keeps its value heads' states in slots rank 0 chose (or whole states where the heads do not split)."""
    model_dir = tiny_model_dir(name)
    expected = _reference(model_dir)
    with cpu_llm(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=16) as llm:
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    for prompt, out, ref in zip(_prompts(), outputs, expected):
        assert tuple(out.token_ids) == ref, f"{name} TP={tp}, prompt of {len(prompt)} tokens"


def test_each_prompt_alone_in_one_step_equals_transformers(tiny_model_dir):
    model_dir = tiny_model_dir(NAME)
    expected = _reference(model_dir)
    with cpu_llm(model_dir) as llm:
        got = [tuple(llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids) for prompt in _prompts()]
        assert_all_returned(llm)
    assert tuple(got) == expected


@pytest.mark.parametrize("name", FAMILIES)
def test_preempted_sequences_recompute_from_an_empty_state(tiny_model_dir, name):
    """A KV cache of 7 blocks of 16 tokens for four sequences that grow to 50 tokens (4 blocks each): later
    arrivals are preempted and recomputed, and still give transformers' tokens."""
    model_dir = tiny_model_dir(name)
    prompts = [p for p in _prompts() if len(p) == 40] + [list(range(100 + i, 140 + i)) for i in range(3)]
    with cpu_llm(model_dir, kv_cache_memory_gb=SEVEN_BLOCKS_GB[name], max_model_len=64) as llm:
        assert llm.engine.block_manager.num_blocks < 16
        outputs = llm.generate(prompts, greedy(NEW_TOKENS))
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_returned(llm)
    assert tuple(outputs[0].token_ids) == _reference(model_dir)[PROMPT_LENGTHS.index(40)]
    with cpu_llm(model_dir, max_model_len=64) as llm:  # room for all: no preemption
        alone = [tuple(llm.generate([p], greedy(NEW_TOKENS))[0].token_ids) for p in prompts[1:]]
    assert [tuple(o.token_ids) for o in outputs[1:]] == alone


@pytest.mark.parametrize("name", FAMILIES)
def test_sixteen_requests_at_once_equal_each_alone(tiny_model_dir, name):
    """Sixteen prompts of 1 to 31 tokens in one batch, each in a state slot of its own, prefilled in chunks beside
    the others' decode steps: each sequence's tokens are those it gives alone."""
    model_dir = tiny_model_dir(name)
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(5, 1000, (1 + (7 * i) % 31,), generator=g).tolist() for i in range(16)]
    with cpu_llm(model_dir, max_num_seqs=16, max_num_batched_tokens=32) as llm:
        together = [tuple(o.token_ids) for o in llm.generate(prompts, greedy(NEW_TOKENS))]
        alone = [tuple(llm.generate([p], greedy(NEW_TOKENS))[0].token_ids) for p in prompts]
        assert_all_returned(llm)
    assert together == alone


@pytest.mark.parametrize("name", FAMILIES)
def test_n_choices_over_http_each_run_in_their_own_state(tiny_model_dir, name):
    """`n: 2` (one engine request a choice, in slots of their own, prefix caching off): greedy, both are
    transformers' tokens; the completion's prompt is counted once."""
    from shardserve.tokenizer import Tokenizer

    model_dir = tiny_model_dir(name)
    prompt = _prompts()[2]
    body = greedy_choices_over_http(model_dir, prompt, 2, NEW_TOKENS)

    expected = Tokenizer.from_model_path(model_dir).decode(list(_reference(model_dir)[2]))
    assert [c["text"] for c in body["choices"]] == [expected, expected]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 2 * NEW_TOKENS,
                             "total_tokens": len(prompt) + 2 * NEW_TOKENS}


@pytest.mark.parametrize("name", FAMILIES)
def test_an_aborted_request_gives_its_slot_back(tiny_model_dir, name):
    model_dir = tiny_model_dir(name)
    prompts = _prompts()
    with cpu_llm(model_dir) as llm:
        engine = llm.engine
        engine.add_request("stays", prompts[1], greedy(NEW_TOKENS))
        engine.add_request("aborted", prompts[2], greedy(max_tokens=100))
        outputs = engine.step() + engine.step()
        assert len(engine.scheduler.free_slots) == engine.config.max_num_seqs - 2
        engine.abort("aborted")
        assert len(engine.scheduler.free_slots) == engine.config.max_num_seqs - 1
        while engine.has_work():
            outputs += engine.step()
        assert_all_returned(llm)
    tokens = [t for out in outputs if out.request_id == "stays" for t in out.new_token_ids]
    assert tuple(tokens) == _reference(model_dir)[1]


def test_prefix_caching_is_off_and_a_repeated_prompt_is_recomputed(tiny_model_dir, caplog):
    """The same prompt after itself, then twice at once (as n > 1 choices of one prompt are): every copy is
    recomputed in a slot of its own, none reuses the other's KV blocks."""
    model_dir = tiny_model_dir(NAME)
    prompt = _prompts()[2]
    with caplog.at_level(logging.INFO, logger="shardserve.engine.llm_engine"):
        with cpu_llm(model_dir, enable_prefix_caching=True) as llm:
            first = llm.generate([prompt], greedy(NEW_TOKENS))[0].token_ids
            again = [out.token_ids for out in llm.generate([prompt, prompt, prompt], greedy(NEW_TOKENS))]
            stats = llm.engine.stats()
            assert_all_returned(llm)
    assert any("prefix caching off" in r.getMessage() for r in caplog.records)
    assert not llm.engine.block_manager.enable_prefix_caching
    assert stats.prefix_hits == 0
    assert [first] + again == [list(_reference(model_dir)[2])] * 4


def test_a_checkpoint_with_a_multi_token_prediction_layer_loads(tiny_model_dir):
    """Released Qwen3-Next checkpoints carry an `mtp.` layer for speculative decoding, which is not served: its
    tensors are left unread, and every tensor of the model still has to be there."""
    import os

    from safetensors.torch import load_file

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models.qwen3_next import Qwen3NextForCausalLM
    from shardserve.weights.loader import load_tensors

    model_dir = tiny_model_dir(NAME)
    cfg = ModelConfig.from_model_path(model_dir)
    model = Qwen3NextForCausalLM(cfg, Communicator(None, 0, 1), torch.float32, max_positions=64)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    extra = {"mtp.fc.weight": torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size),
             "mtp.layers.0.input_layernorm.weight": torch.zeros(cfg.hidden_size)}
    load_tensors(model, [*tensors.items(), *extra.items()], False, "a checkpoint with an mtp layer")
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_tensors(model, [(n, t) for n, t in tensors.items() if n != "model.norm.weight"], False, "one short")


@pytest.mark.parametrize("name", FAMILIES)
def test_after_sleep_and_wake_the_states_start_empty(tiny_model_dir, name):
    """Sleep frees the state pools with the KV cache and waking allocates them again (the canary runs through
    them before and after): a prompt then gives transformers' tokens."""
    model_dir = tiny_model_dir(name)
    with cpu_llm(model_dir) as llm:
        llm.generate([_prompts()[0]], greedy(NEW_TOKENS))
        llm.sleep(1)
        assert llm.engine.runner.state_pools == {}
        llm.wake_up()
        got = llm.generate([_prompts()[1]], greedy(NEW_TOKENS))[0].token_ids
        assert llm.engine.canary_reloads == 0
        assert_all_returned(llm)
    assert tuple(got) == _reference(model_dir)[1]


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_planner_counts_the_weights_a_rank_holds(tiny_model_dir, tp):
    """The memory planner's weights per rank (attention with its output gate, Gated DeltaNet, experts) are what
    rank 0 of `tp` builds."""
    import json
    import os

    from shardserve.config import ModelConfig
    from shardserve.distributed.communicator import Communicator
    from shardserve.models.qwen3_next import Qwen3NextForCausalLM
    from shardserve.planner import weight_elements_per_rank

    model_dir = tiny_model_dir(NAME)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    model = Qwen3NextForCausalLM(ModelConfig.from_hf_dict(hf_config), Communicator(None, 0, tp), torch.float32,
                                 max_positions=64)
    assert weight_elements_per_rank(hf_config, tp, []) == sum(p.numel() for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_on_gpus_in_chunks_equals_transformers(tiny_model_dir, tp):
    """The CUDA path at float32: the state pools on the device, decode steps replayed from CUDA graphs (the
    Triton kernels stepping the states in their slots), the partially rotated attention on torch's SDPA."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPU(s)")
    model_dir = tiny_model_dir(NAME)
    expected = _reference(model_dir)
    with LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory_gb=0.01, max_num_seqs=4,
             max_num_batched_tokens=16, tensor_parallel_size=tp) as llm:
        runner = llm.engine.runner
        assert runner.graphs is not None and "Gated DeltaNet triton fused decode" in runner.plan.describe()
        outputs = llm.generate(_prompts(), greedy(NEW_TOKENS))
        assert_all_returned(llm)
    assert tuple(tuple(o.token_ids) for o in outputs) == expected
