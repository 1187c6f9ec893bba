"""The sampler on crafted logits: greedy, temperature, top-k, top-p, seeds and logprobs behave as a
request's parameters say, whatever else is in the batch and whatever the logits' dtype.

A batch of plain greedy rows takes its tokens with the Triton argmax on the model's logits; on a machine
without CUDA those tests run it in Triton's interpreter on CPU tensors.

The last tests run the engine with detokenize=False: token ids come back, text does not."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from shardserve.engine import sampler as sampler_module
from shardserve.engine.sampler import RowHistory, Sampler
from shardserve.engine.structured_output import AllowedTokens
from shardserve.requests.sampling_params import SamplingParams, StructuredOutput

VOCAB = 64
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=1.0)


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], seq_ids=None):
    seq_ids = list(range(len(params))) if seq_ids is None else seq_ids
    return sampler.sample(logits, seq_ids, params)


def test_greedy_rows_pick_the_argmax_among_sampled_rows():
    logits = _logits(6)
    params = [GREEDY, SAMPLED, GREEDY, SAMPLED, SamplingParams(temperature=0, seed=3), GREEDY]
    tokens, logprobs = _sample(Sampler(0), logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (0, 2, 4, 5)] == [argmax[i] for i in (0, 2, 4, 5)]
    assert all(isinstance(t, int) for t in tokens)
    assert logprobs == [None] * 6


def test_top_k_one_is_greedy():
    logits = _logits(32, seed=1)
    tokens, _ = _sample(Sampler(0), logits, [SamplingParams(temperature=1.5, top_k=1)] * 32)
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-3, 1e-20])
def test_temperature_near_zero_behaves_like_greedy(temperature):
    logits = _logits(32, seed=2) * 10  # large logits: a naive logits / temperature overflows
    for params in (SamplingParams(temperature=temperature),
                   SamplingParams(temperature=temperature, top_k=20, top_p=0.9, seed=5)):
        tokens, _ = _sample(Sampler(0), logits, [params] * 32)
        assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_never_returns_a_token_outside_the_top_k():
    row = _logits(1, seed=3)[0]
    allowed = set(torch.topk(row, 5).indices.tolist())
    sampler = Sampler(0)
    seen: set[int] = set()
    for step in range(5):
        params = [SamplingParams(temperature=3.0, top_k=5)] * 100 + [SamplingParams(temperature=3.0, top_k=5,
                                                                                    seed=step)]
        tokens, _ = _sample(sampler, row.expand(101, -1).contiguous(), params)
        seen.update(tokens)
    assert seen <= allowed
    assert len(seen) == 5, "at a high temperature every one of the top 5 tokens should come up"


def test_top_k_keeps_every_token_tied_with_the_kth():
    row = torch.full((VOCAB,), -5.0)
    row[[10, 20, 30, 40]] = torch.tensor([2.0, 1.0, 1.0, 1.0])  # the 2nd largest is tied three ways
    logits = row.expand(300, -1).contiguous()
    for params in (SamplingParams(temperature=2.0, top_k=2), SamplingParams(temperature=2.0, top_k=2, top_p=0.999)):
        tokens, _ = _sample(Sampler(0), logits, [params] * 300)
        assert set(tokens) == {10, 20, 30, 40}, params


def test_top_p_keeps_only_the_smallest_set_reaching_the_mass():
    # Token 7 alone holds 90% of the mass: top_p 0.8 leaves only it.
    probs = torch.full((VOCAB,), 0.1 / (VOCAB - 1))
    probs[7] = 0.9
    dominant = probs.log().expand(200, -1).contiguous()
    tokens, _ = _sample(Sampler(0), dominant, [SamplingParams(top_p=0.8)] * 199 + [SamplingParams(top_p=0.8, seed=1)])
    assert set(tokens) == {7}

    # 0.5 + 0.3 reaches 0.7; the third token (0.15) is never needed.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    spread = probs.log().expand(400, -1).contiguous()
    tokens, _ = _sample(Sampler(0), spread, [SamplingParams(top_p=0.7)] * 400)
    assert set(tokens) == {1, 3}

    # With top-k 1 of 4 dropped first, top-p works on what is left (renormalised): 0.5 / 0.95 > 0.5.
    tokens, _ = _sample(Sampler(0), spread, [SamplingParams(top_p=0.5, top_k=3)] * 400)
    assert set(tokens) == {1}


def test_sampled_frequencies_follow_the_tempered_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20_000
    for temperature in (1.0, 2.0):
        expected = torch.softmax(probs.log() / temperature, dim=-1)
        tokens, _ = _sample(Sampler(0), probs.log().expand(n, -1).contiguous(),
                            [SamplingParams(temperature=temperature)] * n)
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
        assert torch.allclose(freq, expected, atol=0.015), f"temperature {temperature}: {freq} vs {expected}"


def _seeded_run(target: SamplingParams, others: list[SamplingParams], position: int, steps: int = 20,
                target_id: int = 100) -> list[int]:
    """The target row's tokens over `steps` steps, sampled at `position` among `others`."""
    sampler = Sampler(seed=len(others))  # the engine seed only drives unseeded rows
    tokens = []
    for step in range(steps):
        target_row = _logits(1, seed=1000 + step)
        other_rows = _logits(len(others), seed=step) if others else torch.empty(0, VOCAB)
        logits = torch.cat([other_rows[:position], target_row, other_rows[position:]])
        params = others[:position] + [target] + others[position:]
        seq_ids = list(range(position)) + [target_id] + list(range(position, len(others)))
        got, _ = sampler.sample(logits, seq_ids, params)
        tokens.append(got[position])
    return tokens


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=0.8, seed=123),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=123),
])
def test_seeded_row_gives_the_same_tokens_in_any_batch(target):
    alone = _seeded_run(target, [], 0)
    assert alone == _seeded_run(target, [], 0), "the same seed must give the same tokens run to run"
    assert len(set(alone)) > 3, "temperature 0.8 should actually sample"
    batches = [
        ([SAMPLED, GREEDY, SAMPLED], 1),
        ([SamplingParams(top_k=5), SamplingParams(top_p=0.5, seed=123), SamplingParams(seed=9)], 3),
        ([SAMPLED] * 7, 0),
        ([target, SamplingParams(temperature=2.0, top_k=3, seed=1)], 2),
        ([SAMPLED] * 150, 140),  # drawn in the third chunk of DRAW_CHUNK_ROWS rows
        ([SAMPLED, GREEDY] * 40, 64),  # the first row of the second chunk
    ]
    for others, position in batches:
        assert _seeded_run(target, others, position) == alone, f"batched with {others} at {position}"
    assert _seeded_run(dataclasses.replace(target, seed=124), [], 0) != alone


def test_forget_restarts_a_seeded_sequence():
    sampler = Sampler(0)
    logits = _logits(1, seed=4)
    params = [SamplingParams(temperature=5.0, seed=42)]
    first = [_sample(sampler, logits, params, [7])[0][0] for _ in range(10)]
    sampler.forget(7)
    again = [_sample(sampler, logits, params, [7])[0][0] for _ in range(10)]
    assert again == first
    assert len(set(first)) > 1


def test_logprobs_equal_log_softmax_of_the_logits():
    logits = _logits(5, seed=6)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.7, seed=1, logprobs=2),
              SAMPLED, SamplingParams(temperature=1.0, top_k=3, logprobs=0), SamplingParams(temperature=0, logprobs=1)]
    tokens, logprobs = _sample(Sampler(0), logits, params)
    ref = torch.log_softmax(logits, dim=-1)
    assert logprobs[2] is None
    for i in (0, 1, 3, 4):
        lp = logprobs[i]
        assert lp.token_id == tokens[i]
        # Logprobs are the model's, before temperature and top-k.
        assert lp.logprob == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
        n = params[i].logprobs
        top = torch.topk(ref[i], n) if n else None
        assert [t for t, _ in lp.top] == (top.indices.tolist() if n else [])
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist() if n else [], abs=1e-5)
    assert logprobs[0].top[0][0] == tokens[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_accepted(dtype):
    logits = _logits(4, seed=8).to(dtype)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=2),
              SAMPLED, SamplingParams(temperature=0.9, seed=2, logprobs=1)]
    tokens, logprobs = _sample(Sampler(0), logits, params)
    assert tokens[0] == logits.float()[0].argmax().item()
    assert all(0 <= t < VOCAB for t in tokens)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert logprobs[0].logprob == pytest.approx(ref[0, tokens[0]].item(), abs=1e-5)
    assert logprobs[3].logprob == pytest.approx(ref[3, tokens[3]].item(), abs=1e-5)
    # The same row in float32 samples the same token: the dtype of the logits is not a source of randomness.
    again, _ = _sample(Sampler(0), logits.float(), params)
    assert again[1] == tokens[1] and again[3] == tokens[3]


def test_logits_rows_must_match_the_sequences():
    with pytest.raises(ValueError, match=r"one logits row per sequence.*\(3, 64\) for 2 sequence ids"):
        Sampler(0).sample(_logits(3), [0, 1], [GREEDY, GREEDY])


@pytest.mark.gpu
def test_sampling_on_a_cuda_device_matches_the_cpu_semantics():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    logits = _logits(8, seed=9, vocab=128256).to("cuda", torch.bfloat16)
    params = [GREEDY, SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=0.8, top_k=50, seed=3),
              SamplingParams(top_p=0.9, logprobs=5), SAMPLED, SamplingParams(seed=4), GREEDY,
              SamplingParams(temperature=0.7, top_k=8)]
    tokens, logprobs = _sample(Sampler(0), logits, params)
    cpu = logits.float().cpu()
    argmax = cpu.argmax(dim=-1).tolist()
    assert tokens[0] == argmax[0] and tokens[1] == argmax[1] and tokens[6] == argmax[6]
    assert tokens[2] in torch.topk(cpu[2], 50).indices.tolist()
    assert tokens[7] in torch.topk(cpu[7], 8).indices.tolist()
    ref = torch.log_softmax(cpu[3], dim=-1)
    assert logprobs[3].logprob == pytest.approx(ref[tokens[3]].item(), abs=1e-4)
    assert [t for t, _ in logprobs[3].top] == torch.topk(ref, 5).indices.tolist()
    # A seeded row on the GPU is reproducible and independent of the rest of the batch.
    alone, _ = _sample(Sampler(1), logits[2:3], params[2:3], [2])
    assert alone == [tokens[2]]


# -- the greedy kernel ------------------------------------------------------------------------------

@pytest.fixture
def argmax_kernel(monkeypatch):
    """The device the sampler's greedy kernel runs on here, and the logits it was called with: CUDA if present,
    else CPU tensors in Triton's interpreter (the sampler is told that Triton serves them)."""
    pytest.importorskip("triton")
    from shardserve.kernels.triton import argmax

    calls = []
    real = argmax.greedy_tokens

    def counted(logits):
        calls.append(logits)
        return real(logits)

    monkeypatch.setattr(argmax, "greedy_tokens", counted)
    if torch.cuda.is_available():
        return SimpleNamespace(device="cuda", calls=calls)
    from tests.triton_interpreter import allow_one_element_arrays_as_indices

    allow_one_element_arrays_as_indices()  # the kernel's programs loop up to their part's end
    monkeypatch.setattr(sampler_module, "use_triton", lambda x: True)
    return SimpleNamespace(device="cpu", calls=calls)


def test_an_all_greedy_batch_gets_the_same_tokens_from_the_kernel(argmax_kernel):
    logits = _logits(4, seed=10, vocab=5003).to(argmax_kernel.device, torch.bfloat16)
    logits[1, [17, 4000]] = logits[1].max() + 1  # tied maxima: the first is the token
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=1), GREEDY, SamplingParams(temperature=0, seed=3)]
    pending = Sampler(0).enqueue(logits, [0, 1, 2, 3], params)
    assert len(argmax_kernel.calls) == 1 and argmax_kernel.calls[0] is logits, "not read from the model's logits"
    assert pending.tokens.device == logits.device and pending.host_ints is not None, "no transfer started"
    tokens, logprobs = Sampler.resolve(pending)
    assert tokens == logits.float().argmax(dim=-1).tolist() and tokens[1] == 17
    assert logprobs == [None] * 4
    # Asking for logprobs takes the general path (float32 copy, torch's argmax): the same tokens.
    general, _ = _sample(Sampler(0), logits, [dataclasses.replace(p, logprobs=0) for p in params])
    assert len(argmax_kernel.calls) == 1
    assert general == tokens


def _only_token_allowed(token: int, vocab: int) -> torch.Tensor:
    """A grammar bitmask row [1, words] (int32) allowing `token` alone."""
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int64)
    mask[0, token // 32] = 1 << token % 32
    return (mask - (mask >= 2**31).long() * 2**32).int()  # bit 31 as the int32 sign bit


def test_a_biased_penalized_or_constrained_row_is_still_processed(argmax_kernel):
    logits = _logits(2, seed=11).to(argmax_kernel.device, torch.bfloat16)
    best, second = logits[0].float().topk(2).indices.tolist()
    worst = int(logits[0].float().argmin())
    plain = [RowHistory([1], [], 0)]
    cases = [  # (row 0's params, its history, the grammar masks, the token it must get)
        (SamplingParams(temperature=0, logit_bias=((worst, 100.0),)), plain, None, worst),
        (SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0),
         [RowHistory([1], [best] * 5, 5)], None, second),  # best loses 12: below the second
        (SamplingParams(temperature=0, structured=StructuredOutput("regex", "x")), plain,
         AllowedTokens([0], _only_token_allowed(worst, VOCAB)), worst),
    ]
    for params, history, allowed, token in cases:
        tokens, _ = Sampler(0).sample(logits, [0, 1], [params, GREEDY], history + [RowHistory([1], [], 0)],
                                      allowed)
        assert tokens == [token, int(logits[1].float().argmax())], params
    assert argmax_kernel.calls == []


# -- detokenize=False -------------------------------------------------------------------------------

def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop strings.*detokenize is False.*stop_token_ids"):
        SamplingParams(stop=("###",), detokenize=False)
    SamplingParams(stop_token_ids=(2,), detokenize=False)  # token ids need no text


def test_engine_without_detokenize_returns_the_same_tokens_and_no_text(tiny_model_dir):
    from shardserve.entrypoints.llm import LLM

    prompts = [[5, 17, 300, 42, 9], [800, 12]]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)
    with LLM(tiny_model_dir("llama-tied"), dtype="float32", kv_cache_memory_gb=0.01) as llm:
        with_text = llm.generate(prompts, params)
        without = llm.generate(prompts, dataclasses.replace(params, detokenize=False))
    assert [o.token_ids for o in without] == [o.token_ids for o in with_text]
    assert all(o.text for o in with_text)
    assert all(o.text == "" and o.finish_reason == "length" for o in without)
