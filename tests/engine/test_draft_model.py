"""Speculative decoding with a draft model (engine/draft_model.py): greedy tokens equal those of the engine without it,
at TP 1 and 2, with a draft equal to the target (every proposal accepted) and with another random model; 16 requests
at once equal each alone; preemption, an abort and a draft pool that runs out lose no tokens and leak no block of
either pool; the draft sleeps and wakes with the engine; seeded sampling keeps the target's distribution; bad drafts
are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts
from tests.helpers.state_models import assert_all_returned, greedy

NEW_TOKENS = 16
OPTIONS = {"device": "cpu", "dtype": "float32", "kv_cache_memory_gb": 0.01, "max_num_seqs": 8}


def _draft(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def _models(tiny_model_dir) -> tuple[str, str]:
    """The target, and a draft of its vocabulary that is another random model (other shapes, tied head)."""
    return tiny_model_dir("llama-untied"), tiny_model_dir("llama-tied")


def assert_draft_returned(llm: LLM) -> None:
    """Every block of the draft's pool free, no sequence left in its cache."""
    proposer = llm.engine.proposer
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks, "a draft block leaked"
    assert not proposer.caches


def _generate(llm: LLM, prompts, params, always_propose: bool = True) -> list[list[int]]:
    """The tokens of `prompts`; always_propose: requests never stop proposing (a random draft's proposals would
    stop paying after 8 tokens, and these tests are about what verifying them gives)."""
    if always_propose and llm.engine.proposer is not None:
        llm.engine.proposer.break_even = 0.0
    return [list(o.token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_with_a_draft_model_equal_those_without(tiny_model_dir, tp):
    """A draft equal to the target (its own directory) has every proposal accepted; another random draft has most
    rejected; both give the target's tokens."""
    target, other = _models(tiny_model_dir)
    prompts = random_prompts([3, 11, 25, 40], seed=9)
    with LLM(target, tensor_parallel_size=tp, **OPTIONS) as llm:
        plain = _generate(llm, prompts, greedy(NEW_TOKENS))
    for draft in (target, other):
        with LLM(target, tensor_parallel_size=tp, speculative_config=_draft(draft), **OPTIONS) as llm:
            assert _generate(llm, prompts, greedy(NEW_TOKENS)) == plain, draft
            stats = llm.engine.stats()
            assert_all_returned(llm)
            assert_draft_returned(llm)
        assert stats.spec_drafts > 0
        if draft == target:
            assert stats.spec_accepted_tokens / stats.spec_draft_tokens == 1.0
        else:
            assert stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_sixteen_at_once_equal_each_alone(tiny_model_dir):
    """16 prompts of many lengths in one batch (the draft catches up on all of them in shared passes, chunked by the
    token budget, and proposes for all in one pass a position) equal each alone."""
    target, other = _models(tiny_model_dir)
    prompts = random_prompts([3 + 5 * i for i in range(16)], seed=7)
    with LLM(target, speculative_config=_draft(other, k=4), **{**OPTIONS, "max_num_seqs": 16,
                                                               "max_num_batched_tokens": 128}) as llm:
        together = _generate(llm, prompts, greedy(NEW_TOKENS))
        alone = [_generate(llm, [p], greedy(NEW_TOKENS))[0] for p in prompts]
        assert llm.engine.stats().spec_drafts > 16
        assert_all_returned(llm)
        assert_draft_returned(llm)
    assert together == alone


def test_preemption_an_abort_and_a_full_draft_pool_lose_no_tokens_and_no_blocks(tiny_model_dir):
    """A target cache too small for every sequence at once preempts some mid-speculation (their draft blocks go back
    too); a request aborted between steps gives back the blocks of both pools; a draft pool of 4 blocks leaves
    some sequences without proposals for a while. The tokens are those of an engine without speculation."""
    from shardserve.engine.block_manager import BlockManager

    target, other = _models(tiny_model_dir)
    prompts = random_prompts([20, 24, 28, 31, 26, 22], seed=21)
    small = dict(OPTIONS, kv_cache_memory_gb=0.0002, max_model_len=96, max_num_batched_tokens=64)
    with LLM(target, **small) as llm:
        plain = _generate(llm, prompts, greedy(40))
    with LLM(target, speculative_config=_draft(target), **small) as llm:
        assert llm.engine.block_manager.num_blocks < 6 * 5  # not every sequence's 5 blocks at once
        spec = _generate(llm, prompts, greedy(40))
        assert llm.engine.scheduler.num_preemptions > 0
        engine = llm.engine
        engine.add_request("gone", prompts[0], greedy(40))
        for _ in range(3):
            engine.step()
        assert engine.proposer.caches, "the request was not speculating when aborted"
        engine.abort("gone")
        assert_all_returned(llm)
        assert_draft_returned(llm)
        engine.proposer.blocks = BlockManager(4, 16, enable_prefix_caching=False)  # room for one or two sequences
        starved = _generate(llm, prompts[:3], greedy(40))
        assert_all_returned(llm)
        assert_draft_returned(llm)
    assert spec == plain and starved == plain[:3]


def test_the_draft_sleeps_and_wakes_with_the_engine(tiny_model_dir):
    """After sleeping at level 1 (weights kept in host memory) and level 2 (reloaded from the checkpoint), a draft
    equal to the target still has every proposal accepted, and the tokens are those before sleeping."""
    target, _ = _models(tiny_model_dir)
    prompts = random_prompts([5, 17], seed=4)
    with LLM(target, speculative_config=_draft(target), **OPTIONS) as llm:
        before = _generate(llm, prompts, greedy(NEW_TOKENS))
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            assert _generate(llm, prompts, greedy(NEW_TOKENS)) == before
        stats = llm.engine.stats()
        assert_draft_returned(llm)
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0 and llm.engine.canary_reloads == 0


# Chi-square critical value at p = 0.001 for 7 degrees of freedom (8 cells): a correct sampler fails it once in a
# thousand seeds; the draws are seeded, so the check passes or fails the same way every run.
CHI2_999_7 = 24.322


def _reference_probs(model_dir: str, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """transformers' probabilities of every three-token continuation under params (top_k 2: 8 of them)."""
    from shardserve.engine.sampler import target_probs
    from tests.helpers.reference import transformers_model

    model = transformers_model(model_dir)
    joint = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, mass in joint.items():
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1:].float()
            probs = target_probs(logits, [params])[0]
            for token in probs.nonzero().flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        joint = grown
    return joint


def test_seeded_sampling_keeps_the_targets_distribution(tiny_model_dir):
    """2,000 requests of one prompt, each seeded apart, temperature 1 and top_k 2, three tokens each: the second
    token is the draft's proposal accepted with probability p(d) or a draw from p without it, the third the bonus
    token of an accepted proposal or one decoded alone. Their joint counts follow the target's probabilities
    (chi-square over the 8 continuations)."""
    target, _ = _models(tiny_model_dir)
    prompt = random_prompts([6], seed=31)[0]
    trials = 2000
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=i, ignore_eos=True) for i in range(trials)]
    with LLM(target, speculative_config=_draft(target, k=2), **{**OPTIONS, "max_num_seqs": 64}) as llm:
        outputs = _generate(llm, [prompt] * trials, params)
        stats = llm.engine.stats()
        assert_all_returned(llm)
        assert_draft_returned(llm)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # both branches taken
    expected = _reference_probs(target, prompt, params[0])
    counts = {continuation: 0 for continuation in expected}
    for tokens in outputs:
        assert tuple(tokens) in counts, f"{tokens} is outside every step's top 2"
        counts[tuple(tokens)] += 1
    chi2 = sum((counts[c] - trials * p) ** 2 / (trials * p) for c, p in expected.items())
    assert chi2 < CHI2_999_7, (counts, expected)


def _vocab_mismatch(tmp_path, target: str) -> str:
    """A model directory whose config is the target's with another vocabulary size."""
    with open(f"{target}/config.json") as f:
        config = json.load(f)
    config["vocab_size"] += 24
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("draft, message", [
    (None, "method 'draft_model' needs \"model\""),
    ("missing", "\"model\" '.*missing' does not exist"),
    ("vocab", "\"model\" '.*' has a vocabulary of 1024 tokens but the target LlamaForCausalLM has 1000"),
    ("qwen3-next", "\"model\" '.*' is a Qwen3NextForCausalLM, whose cache is not keys and values"),
])
def test_a_bad_draft_is_refused_naming_the_key_in_llm_and_at_the_cli(tiny_model_dir, tmp_path, capsys, draft,
                                                                      message):
    from shardserve.cli import parse_args
    from shardserve.entrypoints.serve import serve

    target = tiny_model_dir("llama-untied")
    path = {None: None, "missing": str(tmp_path / "missing"), "vocab": _vocab_mismatch(tmp_path, target),
            "qwen3-next": tiny_model_dir("qwen3-next")}[draft]
    config = {"method": "draft_model", "num_speculative_tokens": 2, **({"model": path} if path else {})}
    with pytest.raises(ValueError, match=f"--speculative-config: {message}"):
        LLM(target, speculative_config=config, **OPTIONS)
    argv = ["serve", target, "--device", "cpu", "--speculative-config", json.dumps(config)]
    if path is None:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "argument --speculative-config: method 'draft_model' needs \"model\"" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit, match=f"shardserve serve: --speculative-config: {message}"):
        serve(parse_args(argv))


def test_shardserve_plan_gives_the_draft_and_target_caches_the_engine_builds(tiny_model_dir, capsys):
    """`shardserve plan --speculative-config` splits rank 0's KV budget between the draft's cache and the target's as
    the engine does: the draft's tokens as the engine allocates them, the target's within a block."""
    from shardserve.cli import main

    target, other = _models(tiny_model_dir)
    spec = _draft(other)
    assert main(["plan", target, "--device", "cpu", "--kv-cache-memory", "0.01", "--max-num-seqs", "8",
                 "--speculative-config", json.dumps(spec), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    with LLM(target, speculative_config=spec, **OPTIONS) as llm:
        block = llm.engine.runner.block_size
        target_tokens = llm.engine.runner.num_blocks * block
        draft_runner = llm.engine.proposer.runner
        draft_tokens = draft_runner.num_blocks * block
        draft_weights = sum(p.numel() * p.element_size() for p in draft_runner.model.parameters())
    assert planned["draft_cache_tokens"] == draft_tokens
    assert target_tokens <= planned["max_tokens_in_cache"] < target_tokens + block
    # On CPUs the plan counts the float32 weights and the compact copies that decode steps read beside them.
    assert draft_weights <= planned["draft_weight_bytes"] <= 4 * draft_weights
