"""Grammar masks in the engine: the sampler refuses exactly the tokens a mask leaves out, a constrained sequence
keeps to its grammar in a batch with others (with steps queued ahead forced on, which must wait for its tokens),
and the unconstrained sequences beside it come out as they do alone."""

from __future__ import annotations

import json
import re

import pytest
import torch

from shardserve.engine.grammar import closed_objects
from shardserve.engine.llm_engine import OVERLAP_ENV
from shardserve.engine.structured_output import AllowedTokens, apply_allowed
from shardserve.entrypoints.llm import LLM
from shardserve.requests.sampling_params import SamplingParams, StructuredOutput


def test_a_mask_refuses_exactly_the_tokens_it_leaves_out():
    vocab, rows = 1000, [0, 2]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator)
    allowed = torch.rand(len(rows), vocab, generator=generator) < 0.3
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int64)
    for r in range(len(rows)):
        for token in allowed[r].nonzero().flatten().tolist():
            bitmask[r, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)  # as the engine writes it
    processed = logits.clone()
    apply_allowed(processed, AllowedTokens(rows, bitmask))
    for i, r in enumerate(rows):
        assert torch.equal(processed[r].isfinite(), allowed[i])
        assert torch.equal(processed[r][allowed[i]], logits[r][allowed[i]])
    assert torch.equal(processed[1], logits[1])


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from tests.tiny_models import TINY_SPECS, make_tiny_model

    return make_tiny_model(TINY_SPECS["qwen2"], str(tmp_path_factory.mktemp("bytes")), tokenizer="bytes")


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_and_free_sequences_share_a_batch(byte_model, set_env, overlap):
    set_env({OVERLAP_ENV: "1" if overlap else "0"})
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    constrained = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured=StructuredOutput("json", json.dumps(schema))),
        SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput("regex", r"[a-c]{3}-[0-9]{2}")),
        SamplingParams(max_tokens=40, temperature=1.0, seed=2, ignore_eos=True,
                       structured=StructuredOutput("choice", json.dumps(["yes", "no"]))),
    ]
    with LLM(byte_model, kv_cache_memory_gb=0.05) as llm:
        alone = llm.generate(["hello there"], free)[0].token_ids
        outputs = llm.generate(["hello there", "a", "b", "c"], [free, *constrained])
        engine = llm.engine
        assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
        assert not engine.grammars.matchers  # every matcher forgotten with its sequence
    assert outputs[0].token_ids == alone
    assert json.loads(outputs[1].text)["n"] in range(100)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", outputs[2].text)
    assert outputs[3].text in ("yes", "no")  # ignore_eos: a complete grammar still ends the output
    assert all(o.finish_reason == "stop" for o in outputs[1:])


def test_objects_that_list_their_properties_are_closed_at_every_depth():
    item = {"type": "object", "properties": {"x": {}}}
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": item},
                                               "either": {"anyOf": [item, {"type": "string"}]},
                                               "open": {**item, "additionalProperties": True},
                                               "typed": {**item, "additionalProperties": {"type": "integer"}},
                                               "any": {"type": "object"}},
              "$defs": {"Item": item},
              "allOf": [{"properties": {"y": {}}}]}
    closed = closed_objects(schema)
    shut = {**item, "additionalProperties": False}
    assert "additionalProperties" not in closed  # its allOf adds properties its own list lacks
    assert closed["allOf"] == [{"properties": {"y": {}}}]
    properties = closed["properties"]
    assert properties["items"]["items"] == shut and properties["either"]["anyOf"][0] == shut
    assert properties["open"]["additionalProperties"] is True
    assert properties["typed"]["additionalProperties"] == {"type": "integer"}
    assert properties["any"] == {"type": "object"}  # lists nothing: any object, as json_object
    assert closed["$defs"]["Item"] == shut
    assert schema["properties"]["items"]["items"] == item  # the request's schema is left as it came
