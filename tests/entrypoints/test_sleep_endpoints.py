"""vLLM's sleep endpoints on the real server: POST /sleep, POST /wake_up, GET /is_sleeping; a request
sent while asleep waits and is served after the wake, with the tokens of a model that never slept."""

from __future__ import annotations

import threading
import time

import httpx

from tests.serving import serve_model

PROMPT = "w7 w8 w9"


def _complete(server) -> str:
    return server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text


def test_sleep_wake_and_a_request_that_waits_for_the_wake(tiny_model_dir):
    with serve_model(tiny_model_dir("llama-untied"), tp=2) as server:
        http = server.http()
        expected = _complete(server)
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep", params={"level": "1"}).json() == {"is_sleeping": True, "level": 1}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.get("/health").status_code == 200, "asleep is not unhealthy"

        result: dict = {}
        waiting = threading.Thread(target=lambda: result.update(text=_complete(server)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and "text" not in result, "a request to a sleeping server waits"
        assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
        assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
        waiting.join(timeout=60)
        assert result.get("text") == expected

        http.post("/sleep", params={"level": "2"})
        assert http.post("/wake_up").json() == {"is_sleeping": False}
        assert _complete(server) == expected


def test_bad_sleep_and_wake_parameters_get_400_naming_them(tiny_model_dir):
    with serve_model(tiny_model_dir("qwen3")) as server:
        http = server.http()
        bad = http.post("/sleep", params={"level": "3"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "level" and "level must be 1 or 2" in bad.json()["error"]["message"]
        bad = http.post("/wake_up", params={"tags": "weights,kvcache"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
        assert "kvcache" in bad.json()["error"]["message"]
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_wake_on_request_serves_a_sleeping_server(tiny_model_dir):
    with serve_model(tiny_model_dir("qwen3"), wake_on_request=True) as server:
        expected = _complete(server)
        server.http().post("/sleep", params={"level": "1"})
        assert _complete(server) == expected
        assert httpx.get(f"{server.url}/is_sleeping").json() == {"is_sleeping": False}
