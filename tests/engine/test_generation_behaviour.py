"""What a user of the offline engine observes: the same tokens however the work is scheduled,
reproducible seeded sampling, stop conditions, exact logprobs, and clear errors for bad prompts.

Every case runs the real engine (model runner, paged KV cache, scheduler, sampler, detokenizer)
on a tiny random Llama checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from shardserve.engine.kv_cache import bytes_per_block
from shardserve.engine.llm_engine import OVERLAP_ENV
from shardserve.entrypoints.llm import LLM
from shardserve.requests.outputs import TokenLogprob
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts

MODEL = "llama-tied"  # 2 layers, 2 KV heads of 16 dims
ROOMY_KV_GB = 0.01  # about 1300 blocks of 16 tokens
NUM_LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=123, ignore_eos=True)

_request_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir(MODEL)


@pytest.fixture(scope="module")
def llm(model_dir):
    """A roomy float32 engine shared by the tests that need no special configuration."""
    with LLM(model_dir, dtype="float32", kv_cache_memory_gb=ROOMY_KV_GB) as engine:
        yield engine


def _kv_gb_for_blocks(num_blocks: int, block_size: int) -> float:
    per_block = bytes_per_block(NUM_LAYERS, block_size, KV_HEADS, HEAD_DIM, torch.float32)
    return (num_blocks + 0.5) * per_block / 2**30


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def _stream(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Run requests together through the engine, collecting what a streaming client would see."""
    results = {}
    order = []
    for prompt, params in requests:
        rid = f"stream-{next(_request_ids)}"
        llm.engine.add_request(rid, prompt, params)
        results[rid] = {"deltas": [], "logprobs": [], "tokens": [], "final": None}
        order.append(rid)
    while llm.engine.has_work():
        for out in llm.engine.step():
            r = results[out.request_id]
            assert r["final"] is None, "output after the request finished"
            r["deltas"].append(out.delta_text)
            r["tokens"].extend(out.new_token_ids)
            r["logprobs"].extend(out.new_logprobs or [])
            if out.finished:
                r["final"] = out
    for rid in order:
        r = results[rid]
        assert r["final"] is not None
        assert r["tokens"] == r["final"].token_ids, "streamed tokens must add up to the final token ids"
        assert "".join(r["deltas"]) == r["final"].text, "streamed text must add up to the final text"
    return [results[rid] for rid in order]


# -- the same greedy tokens however the engine schedules the work ------------------------------------

@pytest.mark.parametrize("overlap", ["0", "1"], ids=["step-by-step", "steps-queued-ahead"])
def test_greedy_tokens_independent_of_chunking_and_preemption(model_dir, set_env, overlap):
    set_env({OVERLAP_ENV: overlap})  # steps queued ahead must not change any of it either
    prompts = random_prompts((30, 9, 21, 14, 3))
    with LLM(model_dir, dtype="float32", kv_cache_memory_gb=ROOMY_KV_GB) as roomy:
        expected = [o.token_ids for o in roomy.generate(prompts, GREEDY)]
        assert roomy.engine.scheduler.num_preemptions == 0
        assert _all_blocks_free(roomy)
    assert all(len(t) == GREEDY.max_tokens for t in expected)

    with LLM(model_dir, dtype="float32", kv_cache_memory_gb=ROOMY_KV_GB, max_num_batched_tokens=8) as chunked:
        got = [o.token_ids for o in chunked.generate(prompts, GREEDY)]
        assert _all_blocks_free(chunked)
    assert got == expected, "chunked prefill changed the greedy tokens"

    # 20 blocks of 4 tokens: the five requests need about 50 blocks at once, so the scheduler must
    # preempt and recompute; with an 8-token budget prefills are chunked as well.
    for budget in (2048, 8):
        with LLM(model_dir, dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=budget,
                 kv_cache_memory_gb=_kv_gb_for_blocks(20, 4)) as tight:
            assert tight.engine.block_manager.num_blocks == 20
            outs = tight.generate(prompts, GREEDY)
            assert tight.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
            assert _all_blocks_free(tight)
        assert [o.token_ids for o in outs] == expected, f"preemption changed the greedy tokens (budget {budget})"
        assert all(o.finish_reason == "length" for o in outs)


def test_unwritten_cache_slots_never_reach_attention(model_dir, llm):
    """The KV cache is allocated uninitialised (only block 0 is zeroed), so slots no token has written
    may hold anything, NaN or inf included. A decode step must not read them, not even masked out:
    a masked-out NaN still turns the attention output into NaN."""
    prompts = random_prompts((30, 9, 21, 14, 3))
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for block_size in (16, 4):
        with LLM(model_dir, dtype="float32", block_size=block_size, kv_cache_memory_gb=ROOMY_KV_GB) as poisoned:
            for keys, values in poisoned.engine.runner.kv_caches:
                keys.fill_(float("nan"))
                values.fill_(float("nan"))
                keys[:block_size].zero_()  # what allocate_kv_cache guarantees
                values[:block_size].zero_()
            got = [o.token_ids for o in poisoned.generate(prompts, GREEDY)]
        assert got == expected, f"stale cache contents changed the tokens (block size {block_size})"


def test_generation_capped_by_max_model_len(model_dir):
    with LLM(model_dir, dtype="float32", max_model_len=32, kv_cache_memory_gb=ROOMY_KV_GB) as llm:
        [out] = llm.generate(random_prompts((29,)), GREEDY)
        assert _all_blocks_free(llm)
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


# -- prefix caching ---------------------------------------------------------------------------------

def test_prefix_caching_reuses_blocks_without_changing_tokens(model_dir):
    [long_prompt] = random_prompts((100,), seed=7)
    variant = long_prompt[:70] + random_prompts((20,), seed=8)[0]  # shares 4 full blocks of 16 tokens
    with LLM(model_dir, dtype="float32", kv_cache_memory_gb=ROOMY_KV_GB) as cached:
        bm = cached.engine.block_manager
        [first] = cached.generate([long_prompt], GREEDY)
        assert bm.prefix_hits == 0
        [second] = cached.generate([long_prompt], GREEDY)
        hits = bm.prefix_hits
        # Every full block of the prompt but the one holding its last token: (100 - 1) // 16.
        assert hits == 6
        [third] = cached.generate([variant], GREEDY)
        assert bm.prefix_hits - hits == 4
        assert _all_blocks_free(cached)
    assert second.token_ids == first.token_ids

    with LLM(model_dir, dtype="float32", kv_cache_memory_gb=ROOMY_KV_GB, enable_prefix_caching=False) as plain:
        uncached = [o.token_ids for o in plain.generate([long_prompt, variant], GREEDY)]
        assert plain.engine.block_manager.prefix_hits == 0
    assert uncached == [first.token_ids, third.token_ids]


# -- seeded sampling --------------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    target, *others = random_prompts((12, 30, 5, 17), seed=99)
    alone = llm.generate([target], SEEDED)[0].token_ids
    again = llm.generate([target], SEEDED)[0].token_ids
    assert again == alone, "the same seed must give the same tokens run to run"

    greedy = llm.generate([target], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    assert alone != greedy, "temperature 0.8 should actually sample"

    # Alongside other requests (seeded, unseeded and greedy ones, admitted before and after it).
    unseeded = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    other_seed = SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    mixed = _stream(llm, [(others[0], unseeded), (others[1], GREEDY), (target, SEEDED), (others[2], other_seed),
                          (target, SEEDED)])
    assert mixed[2]["tokens"] == alone
    assert mixed[4]["tokens"] == alone, "two identical seeded requests in one batch must agree"

    different = llm.generate([target], dataclasses.replace(SEEDED, seed=124))[0].token_ids
    assert different != alone, "a different seed should give different tokens"
    assert _all_blocks_free(llm)


def test_top_k_one_is_greedy(llm):
    prompts = random_prompts((11, 4), seed=5)
    greedy = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    top1 = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=1.3, top_k=1,
                                                                      ignore_eos=True))]
    assert top1 == greedy


# -- stop conditions --------------------------------------------------------------------------------

def _first_repeat_free_index(tokens: list[int], start: int) -> int:
    """An index >= start whose token appears nowhere before it and is a 3-digit word ("w123")."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] >= 100)


def _tokens_until(llm: LLM, tokens: list[int], text: str) -> int:
    """How many of tokens it takes for their decoded text to contain text."""
    return next(m for m in range(1, len(tokens) + 1) if text in llm.tokenizer.decode(tokens[:m]))


def test_stop_token_ids_end_generation(llm):
    [prompt] = random_prompts((10,), seed=21)
    greedy = llm.generate([prompt], GREEDY)[0].token_ids
    k = _first_repeat_free_index(greedy, 4)
    stop_id = greedy[k]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stop_id,),
                                                        ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy[:k + 1]
    assert out.token_ids[-1] == stop_id
    assert out.text == llm.tokenizer.decode(greedy[:k])  # the stop token's text is not in the output


def test_stop_string_cuts_text_before_it(llm):
    [prompt] = random_prompts((10,), seed=21)
    greedy = llm.generate([prompt], GREEDY)[0].token_ids
    full_text = llm.tokenizer.decode(greedy)
    k = _first_repeat_free_index(greedy, 4)
    word = llm.tokenizer.decode([greedy[k]])
    assert word.startswith("w") and full_text.count(word) >= 1

    [r] = _stream(llm, [(prompt, SamplingParams(max_tokens=24, temperature=0, stop=(word,), ignore_eos=True))])
    out = r["final"]
    assert out.finish_reason == "stop"
    assert out.text == full_text[:full_text.index(word)]
    assert word not in out.text
    assert out.token_ids == greedy[:_tokens_until(llm, greedy, word)], \
        "generation stops at the token that completes the stop string"

    # A stop string spanning two tokens ("<end of word k> <start of word k+1>"): nothing of it is ever
    # streamed, not even the part carried by the first token.
    next_word = llm.tokenizer.decode([greedy[k + 1]])
    spanning = word[-2:] + " " + next_word[:2]
    assert _tokens_until(llm, greedy, spanning) == k + 2
    [r] = _stream(llm, [(prompt, SamplingParams(max_tokens=24, temperature=0, stop=(spanning,), ignore_eos=True))])
    expected = full_text[:full_text.index(spanning)]
    assert r["final"].finish_reason == "stop"
    assert r["final"].text == expected
    emitted = ""
    for delta in r["deltas"]:
        emitted += delta
        assert expected.startswith(emitted), f"streamed {emitted!r}, which runs into the stop string"
    assert r["final"].token_ids == greedy[:k + 2]
    assert _all_blocks_free(llm)


def test_max_tokens_finishes_with_length(llm):
    [out] = llm.generate(random_prompts((6,), seed=3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


# -- logprobs ---------------------------------------------------------------------------------------

def test_logprobs_match_transformers(llm, model_dir):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts((13, 6), seed=42)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=7, logprobs=5, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    results = _stream(llm, [(prompts[0], sampled), (prompts[1], sampled), (prompts[0], greedy)])

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for (prompt, params), r in zip([(prompts[0], sampled), (prompts[1], sampled), (prompts[0], greedy)], results):
        tokens = r["tokens"]
        lps: list[TokenLogprob] = r["logprobs"]
        assert len(lps) == len(tokens) == 8
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # row i predicts generated token i
        for i, (token, lp) in enumerate(zip(tokens, lps)):
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
            assert len(lp.top) == 5
            top_values = [v for _, v in lp.top]
            assert top_values == sorted(top_values, reverse=True)
            ref_top = torch.topk(ref[i], 5)
            assert [t for t, _ in lp.top] == ref_top.indices.tolist()
            assert top_values == pytest.approx(ref_top.values.tolist(), abs=1e-4)
            assert lp.logprob <= top_values[0] + 1e-6
            if params.temperature == 0:
                assert lp.top[0][0] == token, "a greedy token is the most likely one"
        if params.temperature > 0:
            # The sampled tokens are not all the argmax: the logprobs are checked off the top-1 path too.
            assert any(lp.top[0][0] != t for t, lp in zip(tokens, lps))


# -- tensor parallelism -----------------------------------------------------------------------------

def test_seeded_sampling_same_at_tp1_and_tp2(model_dir, llm):
    prompts = random_prompts((12, 25), seed=77)
    tp1 = [o.token_ids for o in llm.generate(prompts, SEEDED)]
    with LLM(model_dir, tensor_parallel_size=2, dtype="float32", kv_cache_memory_gb=ROOMY_KV_GB) as tp2_llm:
        tp2 = [o.token_ids for o in tp2_llm.generate(prompts, SEEDED)]
        assert _all_blocks_free(tp2_llm)
    assert tp2 == tp1


# -- validation -------------------------------------------------------------------------------------

def test_invalid_prompts_rejected_with_clear_messages(model_dir):
    with LLM(model_dir, dtype="float32", max_model_len=32, kv_cache_memory_gb=ROOMY_KV_GB) as llm:
        params = SamplingParams(max_tokens=4, temperature=0)
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[]], params)
        with pytest.raises(ValueError, match=r"32 tokens.*maximum context length is 32"):
            llm.generate([list(range(5, 37))], params)
        with pytest.raises(ValueError, match=r"token id 1000 is outside the vocabulary"):
            llm.generate([[5, 6, 1000]], params)
        with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary"):
            llm.generate([[5, -1, 6]], params)

        # A batch with one bad prompt is refused as a whole: nothing of it is left queued, and the
        # engine keeps serving correctly afterwards.
        good = random_prompts((8,), seed=11)[0]
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([good, [5, 99999]], params)
        assert not llm.engine.has_work(), "a refused batch must not leave requests in the engine"
        [out] = llm.generate([good], params)
        assert len(out.token_ids) == 4
        assert _all_blocks_free(llm)
