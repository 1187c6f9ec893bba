"""The HTTP server on a GPU, where CUDA graphs and overlapped decoding are on by default: concurrent
streamed and plain requests with different lengths and stop tokens get the same answers as with
overlapped decoding off, a stream cut midway loses nothing else, and every KV block comes back
(runs on the GPU machine)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from shardserve.engine.llm_engine import OVERLAP_ENV
from tests.serving import serve_model

pytestmark = pytest.mark.gpu

PROMPTS = ["w1 w2 w3", "w40 w41", "w7 w8 w9 w10 w11 w12", "w100", "w3 w3 w3 w3", "w9 w8 w7"]


async def _ask_all(server, stop_token: int | None) -> list[tuple[str, str]]:
    client = server.async_openai()

    async def one(i: int, prompt: str):
        extra = {"ignore_eos": True}
        if stop_token is not None and i % 2:
            extra["stop_token_ids"] = [stop_token]
        if i % 3 == 0:
            text, reason = "", None
            stream = await client.completions.create(model=server.model, prompt=prompt, max_tokens=8 + 5 * i,
                                                     temperature=0, stream=True, extra_body=extra)
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason
        out = await client.completions.create(model=server.model, prompt=prompt, max_tokens=8 + 5 * i,
                                              temperature=0, extra_body=extra)
        return out.choices[0].text, out.choices[0].finish_reason

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


async def _cut_a_stream(server) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        body = {"model": server.model, "prompt": "w5 w6", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for _ in response.aiter_lines():
                seen += 1
                if seen > 10:
                    break  # the client goes away mid-stream


def test_overlapped_serving_answers_like_step_by_step(tiny_model_dir, set_env):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model_dir = tiny_model_dir("llama-untied")
    answers = {}
    for overlap in (False, True):
        set_env({OVERLAP_ENV: "1" if overlap else "0"})
        with serve_model(model_dir, device="cuda", dtype="float32", max_num_seqs=8) as server:
            assert server.engine.engine.overlap_steps == overlap
            assert server.engine.engine.runner.graphs is not None
            if "stop" not in answers:  # a token that request 1 really generates third: it stops there
                third_word = asyncio.run(_ask_all(server, None))[1][0].split()[2]
                answers["stop"] = server.engine.engine.tokenizer.encode(third_word, add_special_tokens=False)[0]
            stop_token = answers["stop"]

            async def both():
                return await asyncio.gather(_ask_all(server, stop_token), _cut_a_stream(server))

            answers[overlap], _ = asyncio.run(both())
            assert server.all_blocks_free(), "a KV block was not returned"
            if overlap:
                assert server.engine.engine.steps_overlapped > 20
    assert answers[True] == answers[False]
    assert any(reason == "stop" for _, reason in answers[True]), "no request stopped on its stop token"
