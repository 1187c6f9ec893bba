"""Speculative decoding with n-gram proposals (--speculative-config): greedy tokens equal those of the same engine
without it, at TP 1 and 2, alone and 16 at once, through preemption and an abort; proposals are made and accepted
(the metrics count them); requests that cannot be verified by argmax decode one token a step beside them; models
with recurrent state and bad configurations are refused with a message naming the problem."""

from __future__ import annotations

import pytest
import torch

from shardserve.engine.speculative import accepted_tokens, ngram_proposals
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.helpers.reference import random_prompts
from tests.helpers.state_models import assert_all_returned, greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
NEW_TOKENS = 16


def test_prompt_lookup_takes_what_followed_the_latest_longest_match():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7]
    assert ngram_proposals(tokens, 3, 3, 1) == [1, 5, 6]  # "5 6 7" last seen at 5, followed by 1 5 6
    assert ngram_proposals(tokens, 5, 3, 1) == [1, 5, 6, 7]  # fewer where the sequence ends
    assert ngram_proposals([1, 2, 3, 4], 3, 3, 1) == []  # no earlier occurrence
    assert ngram_proposals([4, 2, 9, 2], 2, 3, 1) == [9, 2]  # down to one token
    assert ngram_proposals([4, 2, 9, 2], 2, 3, 2) == []  # not below prompt_lookup_min


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_targets_next_token():
    assert accepted_tokens([7, 8, 9], [7, 8, 9, 4]) == [7, 8, 9, 4]  # all accepted, plus the bonus token
    assert accepted_tokens([7, 8, 9], [7, 3, 9, 4]) == [7, 3]  # the target's correction ends it
    assert accepted_tokens([7, 8], [1, 8, 9]) == [1]


# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails a check this strict once in
# a thousand seeds; the draws here are seeded, so each check passes or fails the same way every run.
CHI2_999 = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


@pytest.mark.parametrize("top_k", [0, 4])
def test_rejection_sampling_keeps_the_targets_distribution_at_every_position(top_k):
    """Sampler.verify on the same three rows (after the last token, after proposal 0, after proposal 1) 20,000
    times: the first token follows row 0's distribution, the second (where proposal 0 was accepted) row 1's, the
    third (both accepted) row 2's; with top_k 4 no token outside a row's best four appears. A verifier that drew
    the replacement from the whole row instead of the row without the proposal would over-draw the proposal."""
    from shardserve.engine.sampler import Sampler, target_probs

    vocab, trials = 6, 20000
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, vocab, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, top_k=top_k, max_tokens=8)
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argsort()[-1])]  # a likely and a most likely proposal
    probs = target_probs(logits.clone(), [params] * 3)
    out = Sampler(seed=5).verify(logits.repeat(trials, 1), [(i, params, drafts) for i in range(trials)])
    assert all(1 <= len(t) <= 3 for t in out)
    for position in range(3):
        reached = [t for t in out if len(t) > position and t[:position] == drafts[:position]]
        counts = torch.bincount(torch.tensor([t[position] for t in reached]), minlength=vocab).double()
        support = int((probs[position] > 0).sum())
        assert _chi_square(counts, probs[position].double()) < CHI2_999[support - 1], (position, counts.tolist())


def _prompts() -> list[list[int]]:
    """Random prompts, and prompts that repeat themselves (whose continuations prompt lookup can guess)."""
    loops = [(p * 4)[:30] for p in random_prompts([5, 7], seed=3)]
    return random_prompts([3, 11, 25], seed=9) + loops


def _generate(model_dir: str, prompts, params, **options) -> tuple[list[list[int]], LLM]:
    options = {"device": "cpu", "dtype": "float32", "kv_cache_memory_gb": 0.01, "max_num_seqs": 8, **options}
    with LLM(model_dir, **options) as llm:
        outputs = llm.generate(prompts, params)
        assert_all_returned(llm)
        return [list(o.token_ids) for o in outputs], llm


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_greedy_tokens_with_ngram_proposals_equal_those_without(tiny_model_dir, tp, pp):
    """At TP 1 and 2, and over two pipeline stages (the last stage sends every verified row's logits back)."""
    model_dir = tiny_model_dir("llama-untied")
    layout = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    plain, _ = _generate(model_dir, _prompts(), greedy(NEW_TOKENS), **layout)
    spec, llm = _generate(model_dir, _prompts(), greedy(NEW_TOKENS), speculative_config=NGRAM, **layout)
    assert spec == plain
    stats = llm.engine.stats()
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens


def test_sixteen_at_once_equal_each_alone_and_a_sampled_request_keeps_its_tokens(tiny_model_dir):
    """16 greedy prompts at once (several proposals in one step) equal each alone; a seeded sampled request that
    asks for logprobs (which verification does not give) decodes one token a step in the same batches, with the
    tokens it gets without speculation."""
    model_dir = tiny_model_dir("llama-untied")
    prompts = random_prompts([3 + 2 * i for i in range(15)], seed=7) + [(random_prompts([4], seed=5)[0] * 5)]
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=11, ignore_eos=True, logprobs=1)
    params = [greedy(NEW_TOKENS)] * 16 + [sampled]
    with LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_num_seqs=17,
             max_num_batched_tokens=256, speculative_config=NGRAM) as llm:
        together = [list(o.token_ids) for o in llm.generate(prompts + [prompts[0]], params)]
        alone = [list(llm.generate([p], greedy(NEW_TOKENS))[0].token_ids) for p in prompts]
        assert llm.engine.stats().spec_accepted_tokens > 0
        assert_all_returned(llm)
    assert together[:16] == alone
    without, _ = _generate(model_dir, [prompts[0]], sampled)
    assert together[16] == without[0]


def test_preempted_and_aborted_sequences_lose_no_tokens_and_no_blocks(tiny_model_dir):
    """A KV cache too small for every sequence at once: some are preempted mid-speculation and recomputed, with
    the tokens of an engine without speculation; a request aborted between steps gives every block back."""
    model_dir = tiny_model_dir("llama-untied")
    prompts = [(p * 6)[:40] for p in random_prompts([4, 6, 5, 7, 3, 8], seed=21)]
    small = dict(kv_cache_memory_gb=0.00009, max_model_len=96, max_num_batched_tokens=64)  # 11 blocks of 16 tokens
    plain, _ = _generate(model_dir, prompts, greedy(40), **small)
    with LLM(model_dir, device="cpu", dtype="float32", max_num_seqs=8, speculative_config=NGRAM, **small) as llm:
        spec = [list(o.token_ids) for o in llm.generate(prompts, greedy(40))]
        assert llm.engine.scheduler.num_preemptions > 0
        engine = llm.engine
        engine.add_request("gone", prompts[0], greedy(40))
        for _ in range(3):
            engine.step()
        engine.abort("gone")
        while engine.has_work():
            engine.step()
        assert_all_returned(llm)
    assert spec == plain


def test_a_model_with_recurrent_state_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="linear-attention layers"):
        LLM(tiny_model_dir("qwen3-next"), device="cpu", dtype="float32", kv_cache_memory_gb=0.01,
            speculative_config=NGRAM)


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' is not supported yet"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "which method 'ngram' does not take"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number from 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key"),
])
def test_a_bad_configuration_names_what_is_wrong(config, message):
    from shardserve.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=config)


def test_smollm2_quoting_its_prompt_gives_the_same_tokens_with_fewer_steps(smollm2_gguf):
    """The real SmolLM2 GGUF asked to repeat a sentence: prompt lookup proposes the sentence's next words, the
    greedy answer is the one without speculation, and most proposals are accepted."""
    text = "The quick brown fox jumps over the lazy dog near the old river bank."
    prompt = [{"role": "user", "content": f"Repeat exactly: {text}"}]
    params = SamplingParams(max_tokens=24, temperature=0)
    answers = []
    for options in ({}, {"speculative_config": NGRAM}):
        with LLM(smollm2_gguf, device="cpu", kv_cache_memory_gb=0.05, max_model_len=256, **options) as llm:
            answers.append(list(llm.generate([llm.tokenizer.apply_chat_template(prompt)], params)[0].token_ids))
            stats = llm.engine.stats()
    assert answers[1] == answers[0]
    assert stats.spec_accepted_tokens >= stats.spec_draft_tokens // 2 > 0


def test_bench_reports_the_servers_acceptance_over_http(tiny_model_dir):
    """`shardserve bench` (greedy, as it always sends) against a speculating server: each level's acceptance rate
    and tokens a verified step, as the server's /metrics counters give them."""
    from rich.console import Console

    from shardserve.bench.runner import BenchConfig, run_bench
    from shardserve.bench.workload import Workload
    from shardserve.tokenizer import Tokenizer
    from tests.serving import serve_model

    model_dir = tiny_model_dir("llama-untied")
    with serve_model(model_dir, name="spec", kv_cache_memory_gb=0.02, speculative_config=NGRAM) as server:
        workload = Workload(4, output_len=24, input_len=16, tokenizer=Tokenizer.from_model_path(model_dir), seed=4)
        [level] = run_bench(BenchConfig(server.url, "spec", concurrency=(2,), num_warmups=0), workload,
                            Console(quiet=True))
        metrics = server.http().get("/metrics").text
    from prometheus_client.parser import text_string_to_metric_families

    totals = {sample.name: sample.value for family in text_string_to_metric_families(metrics)
              for sample in family.samples if sample.name.startswith("shardserve:spec_decode")}
    drafts, proposed, accepted = (totals[f"shardserve:spec_decode_num_{name}_total"]
                                  for name in ("drafts", "draft_tokens", "accepted_tokens"))
    assert level.completed == 4 and drafts > 0  # the server's counters from zero: this level's
    assert level.speculative == {"acceptance_rate": accepted / proposed, "mean_accepted_length": 1 + accepted / drafts,
                                 "drafts": drafts}


def test_sampled_requests_speculate_reproducibly_and_return_every_block(tiny_model_dir):
    """Seeded sampled requests (temperature, top-p) take proposals too: the same request twice gives the same
    tokens, proposals are verified and some accepted, and every block comes back."""
    model_dir = tiny_model_dir("llama-untied")
    prompts = [(p * 4)[:24] for p in random_prompts([5, 6, 4], seed=13)]
    # A low temperature: the random model's answers then loop, as greedy ones do, so prompt lookup finds them.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.1, top_p=0.95, seed=3, ignore_eos=True)
    with LLM(model_dir, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, speculative_config=NGRAM) as llm:
        first = [list(o.token_ids) for o in llm.generate(prompts, params)]
        again = [list(o.token_ids) for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert_all_returned(llm)
    assert first == again and all(len(t) == NEW_TOKENS for t in first)
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0


def test_break_even_acceptance_solves_tokens_a_step_against_its_cost():
    from shardserve.engine.speculative import break_even_acceptance, stops_paying

    for k, c in ((1, 0.17), (3, 0.16), (4, 0.05)):
        a = break_even_acceptance(k, c)
        assert abs(sum(a ** i for i in range(k + 1)) - (1 + c * k)) < 1e-6
    assert not stops_paying(7, 0, 0.3)  # too few proposals to judge
    assert stops_paying(9, 2, 0.3) and not stops_paying(9, 3, 0.3)


def test_a_request_whose_proposals_keep_failing_stops_proposing(tiny_model_dir, monkeypatch):
    """Proposals that are never right (a proposer of a token the model never picks): after MIN_PROPOSED proposed
    tokens the request decodes one token a step, with the tokens it gives without speculation."""
    from shardserve.engine import speculative

    model_dir = tiny_model_dir("llama-untied")
    prompt = random_prompts([9], seed=17)
    plain, _ = _generate(model_dir, prompt, greedy(NEW_TOKENS))
    never = next(t for t in range(5, 1000) if t not in plain[0])
    monkeypatch.setattr(speculative.NgramProposer, "propose", lambda self, ids, limit: [never] * min(3, limit))
    spec, llm = _generate(model_dir, prompt, greedy(NEW_TOKENS), speculative_config=NGRAM)
    stats = llm.engine.stats()
    assert spec == plain
    assert stats.spec_accepted_tokens == 0 and speculative.MIN_PROPOSED <= stats.spec_draft_tokens < \
        speculative.MIN_PROPOSED + 3


def test_rows_to_verify_as_decode_rows_give_the_logits_of_their_chunk(tiny_model_dir):
    """A step verifying proposals replays the decode graphs as one-token rows (StepBatch.decode_rows): each row
    attends up to its own position, after its sequence's earlier rows stored their keys, so its logits are those
    of the chunk computed whole; the rows that sample are the same, in the same order."""
    from shardserve.attention.batch import StepBatch
    from shardserve.wire.step_plan import SeqChunk

    with LLM(tiny_model_dir("llama-untied"), dtype="float32", kv_cache_memory_gb=0.01) as llm:
        runner = llm.engine.runner
        bs = runner.block_size
        tables = [[1, 2, 3], [4, 5]]
        prompts = random_prompts((21, 9), seed=3, vocab=runner.model_config.vocab_size)

        def run(batch: StepBatch) -> torch.Tensor:
            meta = runner.attention.build_metadata(batch)
            hidden = runner.model(torch.tensor(batch.token_ids), torch.tensor(batch.positions),
                                  runner._layer_caches(batch), meta)
            return runner.model.compute_logits(hidden[torch.tensor(batch.sample_rows)])

        run(StepBatch.from_chunks([SeqChunk(i, 0, p, t, True) for i, (p, t) in enumerate(zip(prompts, tables))], bs))
        verify = [SeqChunk(0, 21, [7, 8, 9, 10], tables[0], True, draft=3),
                  SeqChunk(1, 9, [11, 12], tables[1], True, draft=1)]
        whole = StepBatch.from_chunks(verify, bs)
        rows = StepBatch.decode_rows(verify, bs)
        assert rows.decode_only and rows.rows_share_sequences and rows.num_decode == 6
        assert rows.sample_seq_ids == whole.sample_seq_ids == [0] * 4 + [1] * 2
        assert rows.positions == [21, 22, 23, 24, 9, 10]
        expected = run(whole)
        torch.testing.assert_close(run(rows), expected, rtol=1e-5, atol=1e-5)
