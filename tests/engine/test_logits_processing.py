"""Per-request logits processing: logit_bias, min_tokens, the repetition, presence and frequency penalties
and min_p, applied by the sampler to the rows that ask for them, in vLLM's order, and seen through the engine
the same with overlapped decoding on or off.

The sampler is checked against a float64 reference of the whole chain, row by row, on mixed batches; seeded
rows are redrawn with the sampler's documented exponential race (argmax of p / q, q ~ Exp(1) from the row's
own generator), so a row's token must match exactly.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch

from shardserve import envs
from shardserve.engine.llm_engine import OVERLAP_ENV
from shardserve.engine.sampler import RowHistory, Sampler
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams
from tests.tiny_models import VOCAB_SIZE

VOCAB = 512
EOS_IDS = (2, 7)
MODEL = "llama-tied"
MODEL_EOS = 4  # the tiny tokenizer's eos, <|im_end|>


# -- reference ------------------------------------------------------------------------------------------
def _reference_processed(row: torch.Tensor, p: SamplingParams, history: RowHistory) -> torch.Tensor:
    """Logit bias, min_tokens and the penalties on one float64 row."""
    x = row.double().clone()
    for token, bias in dict(p.logit_bias).items():
        x[token] += bias
    if history.num_generated < p.min_tokens:
        for token in (*(() if p.ignore_eos else EOS_IDS), *p.stop_token_ids):
            x[token] = float("-inf")
    for token in set(history.prompt_token_ids) | set(history.output_token_ids):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in Counter(history.output_token_ids).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return x


def _reference_probs(processed: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row draws from: temperature, min_p, top-k, top-p, in float64."""
    x = processed / p.temperature
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1:
        ordered, order = x.sort(descending=True, stable=True)
        sorted_probs = torch.softmax(ordered, dim=-1)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        x = x.clone()
        x[order[drop]] = float("-inf")
    return torch.softmax(x, dim=-1)


def _reference_token(row: torch.Tensor, p: SamplingParams, history: RowHistory) -> int:
    processed = _reference_processed(row, p, history)
    if p.greedy:
        return int(processed.argmax())
    noise = torch.empty(row.numel()).exponential_(generator=torch.Generator().manual_seed(p.seed))
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return int((_reference_probs(processed, p) / noise.double()).argmax())


# -- a mixed batch ----------------------------------------------------------------------------------------
PROCESSORS = [
    {},
    {"logit_bias": ((3, 8.0), (11, -100.0), (40, 2.5), (3, 5.0))},  # token 3 listed twice: the last value
    {"min_tokens": 4},
    {"min_tokens": 2, "stop_token_ids": (13, 99), "ignore_eos": True},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7},
    {"presence_penalty": -1.0, "frequency_penalty": -0.4},
    {"min_p": 0.1},
    {"logit_bias": ((5, 4.0),), "min_tokens": 8, "stop_token_ids": (5,), "repetition_penalty": 1.3,
     "presence_penalty": 0.4, "frequency_penalty": 0.9, "min_p": 0.05},
]
DRAWS = [
    {"temperature": 0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 20},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
]


def _history(g: torch.Generator, min_tokens: int) -> RowHistory:
    prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 40, (), generator=g)),), generator=g).tolist()
    # Output tokens drawn from a narrow range, so that tokens repeat and counts exceed 1.
    output = torch.randint(0, 30, (int(torch.randint(0, 2 * min_tokens + 12, (), generator=g)),),
                           generator=g).tolist()
    return RowHistory(prompt, output, len(output))


def _mixed_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    params, histories = [], []
    for n, (processors, draw) in enumerate(itertools.product(PROCESSORS, DRAWS)):
        params.append(SamplingParams(max_tokens=64, seed=seed * 1000 + n, **processors, **draw))
        histories.append(_history(g, params[-1].min_tokens))
    logits = torch.randn(len(params), VOCAB, generator=g) * 4
    # Make the stop tokens likely, so that min_tokens has something to do.
    logits[:, list(EOS_IDS) + [5, 13]] += 6
    return logits, params, histories


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_sampler_matches_the_reference_chain_on_mixed_batches(seed):
    logits, params, histories = _mixed_batch(seed)
    seq_ids = list(range(len(params)))
    tokens, _ = Sampler(0, EOS_IDS).sample(logits, seq_ids, params, histories)
    expected = [_reference_token(row, p, h) for row, p, h in zip(logits, params, histories)]
    assert tokens == expected
    plain = [i for i, p in enumerate(params) if not p.processes_logits and p.greedy]
    assert [tokens[i] for i in plain] == logits[plain].argmax(-1).tolist()
    # The processing changed some greedy choices, or this test would prove little.
    greedy = [i for i, p in enumerate(params) if p.greedy]
    assert any(tokens[i] != int(logits[i].argmax()) for i in greedy)


def test_batches_past_one_chunk_of_rows_match_the_reference_chain():
    """Three mixed batches as one (165 rows: penalized and drawn DRAW_CHUNK_ROWS rows at a time) give every
    row the reference chain's token."""
    from shardserve.engine.sampler import DRAW_CHUNK_ROWS

    batches = [_mixed_batch(seed) for seed in (4, 5, 6)]
    logits = torch.cat([b[0] for b in batches])
    params = [p for b in batches for p in b[1]]
    histories = [h for b in batches for h in b[2]]
    assert len(params) > 2 * DRAW_CHUNK_ROWS
    tokens, _ = Sampler(0, EOS_IDS).sample(logits, list(range(len(params))), params, histories)
    assert tokens == [_reference_token(row, p, h) for row, p, h in zip(logits, params, histories)]


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_bfloat16_logits_are_processed_in_a_copy_of_their_own(with_logprobs):
    """From bf16 logits (as the model returns them) the sampler's float32 copy is processed in place: the
    caller's tensor stays as it was, the tokens are the reference's on the float32 values, and logprobs stay
    the model's own."""
    logits, params, histories = _mixed_batch(5)
    logits = logits.bfloat16()
    if with_logprobs:
        params = [dataclasses.replace(p, logprobs=2) for p in params]
    before = logits.clone()
    tokens, logprobs = Sampler(0, EOS_IDS).sample(logits, list(range(len(params))), params, histories)
    assert torch.equal(logits, before), "the caller's logits were written"
    expected = [_reference_token(row, p, h) for row, p, h in zip(logits.float(), params, histories)]
    assert tokens == expected
    if with_logprobs:
        raw = torch.log_softmax(logits.float(), dim=-1)
        assert [lp.logprob for lp in logprobs] == pytest.approx([float(raw[i, t]) for i, t in enumerate(tokens)],
                                                                abs=1e-5)


def test_a_row_is_processed_the_same_alone_as_in_a_batch():
    logits, params, histories = _mixed_batch(4)
    seq_ids = list(range(len(params)))
    together, _ = Sampler(0, EOS_IDS).sample(logits, seq_ids, params, histories)
    alone = [Sampler(0, EOS_IDS).sample(logits[i:i + 1], [i], [params[i]], [histories[i]])[0][0]
             for i in range(len(params)) if params[i].seed is not None]
    assert alone == together


def test_min_tokens_masks_stop_tokens_only_before_the_count():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS_IDS[0]] = 10
    logits[:, 13] = 9
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(13,))] * 3 + [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(13,), ignore_eos=True)]
    histories = [RowHistory([1], [], 0), RowHistory([1], [8, 8], 2), RowHistory([1], [8, 8], 3),
                 RowHistory([1], [], 0)]
    tokens, _ = Sampler(0, EOS_IDS).sample(logits, [0, 1, 2, 3], params, histories)
    # Rows 0 and 1 have fewer than 3 tokens (row 2 has a third in flight); with ignore_eos, eos is no stop token.
    assert tokens[0] not in (EOS_IDS[0], 13) and tokens[1] not in (EOS_IDS[0], 13)
    assert tokens[2:] == [EOS_IDS[0], EOS_IDS[0]]


def test_logit_bias_moves_the_greedy_argmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    best, second = torch.topk(logits[0], 2).indices.tolist()
    worst = int(logits[0].argmin())
    params = [SamplingParams(temperature=0, logit_bias=((worst, 100.0),)),
              SamplingParams(temperature=0, logit_bias=((best, -100.0),)),
              SamplingParams(temperature=0)]
    tokens, _ = Sampler(0).sample(logits[[0, 0, 0]], [0, 1, 2], params)
    assert tokens == [worst, second, best]


def test_reported_logprobs_are_the_models_own():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [SamplingParams(temperature=0, logit_bias=((9, 100.0),), repetition_penalty=2.0, logprobs=3),
              SamplingParams(temperature=0.8, seed=1, min_p=0.2, presence_penalty=1.0, logprobs=3)]
    histories = [RowHistory([1, 2], [3], 1), RowHistory([4], [5, 5], 2)]
    tokens, logprobs = Sampler(0).sample(logits, [0, 1], params, histories)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert tokens[0] == 9
    for row, (token, lp) in enumerate(zip(tokens, logprobs)):
        assert lp.logprob == pytest.approx(float(raw[row, token]), abs=1e-5)
        top = torch.topk(raw[row], 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()


def test_rows_without_processing_take_the_plain_path(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("logits were processed for a batch that asks for none")

    monkeypatch.setattr(Sampler, "_processed", fail)
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=5, seed=2)] * 2
    tokens, _ = Sampler(0).sample(logits, [0, 1, 2, 3], params)
    assert tokens[0] == int(logits[0].argmax())


def test_history_is_required_for_min_tokens_and_penalties():
    with pytest.raises(ValueError, match="history"):
        Sampler(0).sample(torch.randn(1, VOCAB), [0], [SamplingParams(frequency_penalty=0.5)])


# -- through the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return tiny_model_dir(MODEL)


@pytest.fixture(scope="module")
def engines(model_dir):
    """{overlap: LLM}: one engine with overlapped decoding forced on, one with it off."""
    llms = {}
    for overlap in (False, True):
        with envs.override({OVERLAP_ENV: "1" if overlap else "0"}):
            llms[overlap] = LLM(model_dir, dtype="float32", kv_cache_memory_gb=0.02, max_num_seqs=8)
    yield llms
    for llm in llms.values():
        llm.shutdown()


PROMPTS = [[5, 9, 13], [40, 41], [7, 8, 9, 10, 11, 12], [100], [3, 3, 3, 3]]


def _generate(llm: LLM, params: SamplingParams) -> tuple[list[list[int]], int]:
    """Each prompt's tokens, and how many steps were queued ahead meanwhile."""
    before = llm.engine.steps_overlapped
    outputs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outputs], llm.engine.steps_overlapped - before


@pytest.mark.parametrize("overlap", [False, True])
def test_min_tokens_holds_off_likely_stop_tokens(engines, overlap):
    stop_token = 17
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=5, stop_token_ids=(stop_token,),
                            logit_bias=((MODEL_EOS, 100.0), (stop_token, 100.0)))
    llm = engines[overlap]
    before = llm.engine.steps_overlapped
    outputs = llm.generate(PROMPTS, params)
    assert (llm.engine.steps_overlapped > before) == overlap
    for out in outputs:
        assert out.finish_reason == "stop"
        assert len(out.token_ids) == params.min_tokens + 1
        assert not {MODEL_EOS, stop_token} & set(out.token_ids[:-1])
        assert out.token_ids[-1] in (MODEL_EOS, stop_token)


def test_penalties_give_the_same_tokens_with_overlap_on_or_off(engines):
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    penalized = dataclasses.replace(plain, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    unpenalized, overlapped = _generate(engines[True], plain)
    assert overlapped > 0
    expected, _ = _generate(engines[False], penalized)
    got, overlapped = _generate(engines[True], penalized)
    assert got == expected  # the token still on the device when a step is queued ahead is counted from there
    assert overlapped > 0, "penalized sequences decode with steps queued ahead too"
    assert got != unpenalized
    # The frequency penalty makes a token less likely each time it comes: fewer repeats than without.
    repeats = sum(len(t) - len(set(t)) for t in got)
    assert repeats < sum(len(t) - len(set(t)) for t in unpenalized)


def test_a_logit_bias_outside_the_vocabulary_is_refused(engines):
    with pytest.raises(ValueError, match="logit_bias token id"):
        engines[False].generate(PROMPTS[:1], SamplingParams(logit_bias=((VOCAB_SIZE, 1.0),)))


def test_a_penalized_request_among_plain_ones_with_overlap(engines):
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    penalized = dataclasses.replace(plain, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)
    # (step it joins at, params): the penalized request joins later, so the steps before it and after it
    # finishes are overlapped.
    schedule = [(0, plain), (0, plain), (3, penalized), (0, dataclasses.replace(plain, max_tokens=30))]

    def run(llm: LLM) -> tuple[dict[str, list[int]], int]:
        engine = llm.engine
        before = engine.steps_overlapped
        outputs, step = {}, 0
        waiting = dict(enumerate(schedule))
        while waiting or engine.has_work():
            for i in [i for i, (start, _) in waiting.items() if start <= step]:
                engine.add_request(f"mixed-{i}", PROMPTS[i], waiting.pop(i)[1])
            for out in engine.step():
                outputs[out.request_id] = out.token_ids
            step += 1
        return outputs, engine.steps_overlapped - before

    expected, _ = run(engines[False])
    got, overlapped = run(engines[True])
    assert got == expected
    assert overlapped > 0


def test_penalties_kept_on_the_device_between_steps_equal_a_fresh_count_every_step():
    """One sampler over many steps (counts updated with each step's new tokens, finished sequences' slots
    reused) picks what a sampler counting each row's whole history from nothing picks."""
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3)
    prompts = {s: torch.randint(0, VOCAB, (9,), generator=gen).tolist() for s in range(6)}
    outputs: dict[int, list[int]] = {s: [] for s in prompts}
    running, waiting = [0, 1, 2], [3, 4, 5]
    kept = Sampler(0, EOS_IDS)
    for step in range(24):
        logits = torch.randn(len(running), VOCAB, generator=gen) * 3
        histories = [RowHistory(prompts[s], list(outputs[s]), len(outputs[s])) for s in running]
        got, _ = kept.sample(logits, running, [params] * len(running), histories)
        fresh, _ = Sampler(0, EOS_IDS).sample(logits, running, [params] * len(running), histories)
        assert got == fresh, f"step {step}"
        for s, token in zip(running, got):
            outputs[s].append(token)
        if step % 8 == 7 and waiting:  # a sequence finishes, a new one takes its slot
            done = running.pop(0)
            kept.forget(done)
            running.append(waiting.pop(0))


def test_penalty_counts_stay_within_what_the_planner_reserves():
    """100 penalized sequences sampled step after step (each already holding a slot after the first) keep the
    token-count tensors at the slots of 100 sequences, within TokenCounts.peak_bytes, which the planner counts."""
    from shardserve.engine.sampler import TokenCounts
    from shardserve.planner import PlanRequest, plan, sampling_bytes

    g = torch.Generator().manual_seed(9)
    sequences = 100
    params = [SamplingParams(max_tokens=64, temperature=0, frequency_penalty=0.5)] * sequences
    histories = [_history(g, 0) for _ in range(sequences)]
    sampler = Sampler(0, EOS_IDS)
    for step in range(3):
        logits = torch.randn(sequences, VOCAB, generator=g)
        tokens, _ = sampler.sample(logits, list(range(sequences)), params, histories)
        histories = [dataclasses.replace(h, output_token_ids=[*h.output_token_ids, t],
                                         num_generated=h.num_generated + 1) for h, t in zip(histories, tokens)]
    counts = sampler._token_counts
    assert counts.counts.shape == (128, VOCAB), "slots for 100 sequences: the next power of two"
    held = counts.counts.numel() * 4 + counts.in_prompt.numel()
    assert held <= TokenCounts.peak_bytes(sequences, VOCAB)
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 150_000, "torch_dtype": "bfloat16"}
    with_penalties = plan(cfg, PlanRequest(max_num_seqs=512, gpu_memory_gb=80)).overhead_bytes
    # 511 more sequences' logits and their sampling
    logits = 511 * 150_000 * 4 + sampling_bytes(512, 150_000) - sampling_bytes(1, 150_000)
    assert with_penalties - plan(cfg, PlanRequest(max_num_seqs=1, gpu_memory_gb=80)).overhead_bytes \
        >= logits + TokenCounts.peak_bytes(512, 150_000) - TokenCounts.peak_bytes(1, 150_000)
