"""The real engine behind the real HTTP server, driven with the real openai client."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from tests.serving import serve_cli, serve_model


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(f"w{rng.randrange(5, 1000)}" for _ in range(n_words))


@pytest.fixture(scope="module")
def tiny_tp2(tiny_model_dir):
    with serve_model(tiny_model_dir("llama-tied"), tp=2, max_num_seqs=16, max_num_batched_tokens=64) as server:
        yield server


def test_concurrent_requests_match_their_solo_runs_and_free_every_block(tiny_tp2):
    rng = random.Random(7)
    jobs = [(_prompt(rng, rng.randrange(1, 60)), rng.randrange(4, 40)) for _ in range(32)]
    client = tiny_tp2.openai()
    solo = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p, n in jobs]

    async def run_all():
        aclient = tiny_tp2.async_openai()
        return await asyncio.gather(*(aclient.completions.create(
            model="tiny", prompt=p, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}) for p, n in jobs))

    together = asyncio.run(run_all())
    for i, (response, expected) in enumerate(zip(together, solo)):
        assert response.choices[0].text == expected, f"request {i} differs when batched with others"
        assert response.usage.completion_tokens == jobs[i][1]
    assert tiny_tp2.all_blocks_free(), "KV blocks leaked after all requests finished"


def test_client_disconnect_mid_stream_returns_its_blocks(tiny_tp2):
    client = tiny_tp2.openai()
    stream = client.completions.create(model="tiny", prompt="w10 w11 w12 w13", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = 0
    for _ in stream:
        received += 1
        if received == 3:
            break
    stream.close()
    assert tiny_tp2.all_blocks_free(), "the cancelled stream's KV blocks did not return to the pool"
    # The server keeps serving.
    again = client.completions.create(model="tiny", prompt="w10 w11", max_tokens=5, temperature=0)
    assert again.usage.completion_tokens >= 1


def test_prompt_over_max_model_len_is_refused_naming_limit_and_length(tiny_model_dir):
    with serve_model(tiny_model_dir("qwen2"), max_model_len=64) as server:
        with server.http() as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": " ".join(["w7"] * 80)})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "64" in message and "80" in message


def test_smollm2_gguf_tp2_answers_paris_streamed_and_not(smollm2_gguf):
    with serve_cli([smollm2_gguf, "-tp", "2", "--served-model-name", "smol", "--max-model-len", "2048",
                    "--kv-cache-memory", "0.5"], timeout=600) as url:  # first start builds the CPU kernel
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model="smol", messages=messages, temperature=0, max_tokens=40)
        text = answer.choices[0].message.content
        assert "Paris" in text
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="smol", messages=messages, temperature=0, max_tokens=40, stream=True) if chunk.choices)
        assert streamed == text
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "smol"


def test_readme_tp2_command_answers_paris_on_a_cpu_without_native_bfloat16(smollm2_gguf):
    """The README's command, exactly, with oneDNN held to AVX-512 without BF16 (the Xeon on which it once
    answered "L'Étoile, la Marseillaise, la femme, ..." with HTTP 200): forced here on any CPU."""
    with serve_cli([smollm2_gguf, "-tp", "2", "--device", "cpu", "--served-model-name", "smollm2"],
                   timeout=600, env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}) as url:
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=24)
        assert "Paris" in answer.choices[0].message.content
