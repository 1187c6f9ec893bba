"""The prompts bench sends: distinct between requests and levels, a shared prefix only when asked,
exact lengths with a tokenizer, and dataset errors that name the line."""

from __future__ import annotations

import json
import random

import pytest

from shardserve.bench.runner import arrival_offsets
from shardserve.bench.workload import WORDS, Workload, WorkloadError, load_dataset
from shardserve.tokenizer import Tokenizer


def test_random_prompts_differ_from_the_first_word_across_requests_and_levels():
    workload = Workload(num_prompts=50, output_len=8, input_len=32, seed=7)
    prompts = [r.prompt for level in range(3) for r in workload.requests(level)]
    assert len({tuple(p.split()[:3]) for p in prompts}) == len(prompts), "first three words are all distinct"
    assert all(len(p.split()) == 32 and set(p.split()) <= set(WORDS) for p in prompts)
    assert workload.requests(1) == Workload(50, 8, 32, seed=7).requests(1), "same seed, same prompts"


def test_shared_prefix_is_the_same_everywhere_and_the_rest_differs():
    workload = Workload(num_prompts=20, output_len=8, input_len=32, shared_prefix=10, seed=7)
    words = [r.prompt.split() for level in range(2) for r in workload.requests(level)]
    assert len({tuple(w[:10]) for w in words}) == 1
    assert len({tuple(w[10:13]) for w in words}) == len(words)


def test_tokenizer_makes_prompts_exactly_input_len_tokens(tiny_model_dir):
    tokenizer = Tokenizer.from_model_path(tiny_model_dir("llama-tied"))
    workload = Workload(num_prompts=10, output_len=8, input_len=40, shared_prefix=16, tokenizer=tokenizer, seed=3)
    encoded = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in workload.requests(0)]
    assert all(len(ids) == 40 for ids in encoded)
    assert len({tuple(ids[:16]) for ids in encoded}) == 1
    assert len({tuple(ids[16:]) for ids in encoded}) == 10


def test_a_32k_prompt_is_exactly_its_length_with_a_word_level_tokenizer(tiny_model_dir):
    """`bench --input-len 32768`: the prompt a whitespace pre-tokenizer counts (as the server's usage will) is
    32768 tokens, special ids among the random ones refilled."""
    tokenizer = Tokenizer.from_model_path(tiny_model_dir("llama-tied"))
    request, = Workload(num_prompts=1, output_len=8, input_len=32768, tokenizer=tokenizer, seed=5).requests(0)
    assert len(tokenizer.encode(request.prompt, add_special_tokens=False)) == 32768


def test_dataset_prompts_get_a_distinct_tag_and_keep_their_text(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "Say hi.", "output_len": 5}), "",
                               json.dumps({"messages": [{"role": "user", "content": "Hello?"}]})]) + "\n")
    workload = Workload(num_prompts=6, output_len=9, dataset=load_dataset(str(path)), seed=1)
    requests = workload.requests(0) + workload.requests(1)
    assert [r.output_len for r in requests[:2]] == [5, 9]
    assert not requests[0].is_chat and requests[1].is_chat
    assert requests[0].prompt.endswith("\nSay hi.") and requests[1].messages[0]["content"].endswith("\nHello?")
    firsts = [r.prompt if not r.is_chat else r.messages[0]["content"] for r in requests]
    assert len({text.split("\n")[0] for text in firsts}) == len(requests)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', 'exactly one of "prompt"'),
    ('{"prompt": "a", "max_tokens": 3}', "max_tokens: Extra inputs are not permitted"),
    ('{"prompt": "a", "output_len": 0}', "output_len: Input should be greater than 0"),
    ('{"messages": [{"role": "robot", "content": "b"}]}', "messages.0.role"),
    ("prompt: a", "not JSON"),
])
def test_dataset_errors_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=f"bad.jsonl:2: .*{message}"):
        load_dataset(str(path))


def test_poisson_arrivals_average_the_requested_rate():
    offsets = arrival_offsets(4000, 20.0, random.Random(0))
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 20.0, rel=0.05)
    assert arrival_offsets(3, None, random.Random(0)) == [0.0, 0.0, 0.0]
