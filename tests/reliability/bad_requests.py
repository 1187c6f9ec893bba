"""The hand-written list of bad requests: each one, the status it must get and the field its error must name.

Every answer must be a 4xx (never a 5xx) with an OpenAI-shaped body (fuzz.openai_error_problem) whose
`param` is the field at fault; a body that cannot be read at all names no field (`param` None) but says
why in its message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from tests.reliability.fuzz import openai_error_problem

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = {"model": "tiny", "prompt": "w10 w11 w12", "max_tokens": 2}
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "w10 w11"}], "max_tokens": 2}


@dataclass(frozen=True)
class BadRequest:
    name: str
    path: str
    body: bytes
    status: int
    param: str | None  # the field the error must name; None: the body as a whole
    says: str = ""  # words the message must contain (for errors about the whole body)
    content_type: str = "application/json"


def _json(base: dict[str, Any], **changes: Any) -> bytes:
    return json.dumps({**base, **changes}).encode()


def _words(n: int) -> str:
    return " ".join(["w7"] * n)  # one token per word with the tiny models' tokenizer


def bad_requests(max_model_len: int, body_limit_bytes: int) -> list[BadRequest]:
    return [
        BadRequest("invalid JSON", COMPLETIONS, b'{"prompt": "w7", "max_tokens": ', 400, None, "not valid JSON"),
        BadRequest("JSON that is not an object", CHAT, b"[1, 2]", 400, None, "must be a JSON object"),
        BadRequest("empty body", COMPLETIONS, b"", 400, None, "body is empty"),
        BadRequest("not JSON content type", COMPLETIONS, _json(PROMPT), 400, None, "Content-Type: application/json",
                   content_type="text/plain"),
        BadRequest("invalid UTF-8", COMPLETIONS, b'{"prompt": "w7 \xff\xfe", "max_tokens": 2}', 400, None,
                   "not valid UTF-8"),
        BadRequest("unpaired surrogate in the prompt", COMPLETIONS, b'{"prompt": "w7 \\ud800", "max_tokens": 2}',
                   400, "prompt"),
        BadRequest("nested too deeply", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
                   None, "nested too deeply"),
        BadRequest("body over the size limit", COMPLETIONS,
                   _json(PROMPT, prompt="w7 " * (body_limit_bytes // 3 + 1)), 413, None, "larger than"),
        BadRequest("10 MB body", CHAT, _json(CHAT_BODY, user="x" * (10 * 2**20)), 413, None, "larger than"),
        BadRequest("missing prompt", COMPLETIONS, _json({"max_tokens": 2}), 400, "prompt"),
        BadRequest("prompt of the wrong type", COMPLETIONS, _json(PROMPT, prompt=5), 400, "prompt"),
        BadRequest("max_tokens as a string", COMPLETIONS, _json(PROMPT, max_tokens="ten"), 400, "max_tokens"),
        BadRequest("negative max_tokens", COMPLETIONS, _json(PROMPT, max_tokens=-5), 400, "max_tokens"),
        BadRequest("zero max_tokens", CHAT, _json(CHAT_BODY, max_tokens=0), 400, "max_tokens"),
        BadRequest("huge max_tokens", COMPLETIONS, _json(PROMPT, max_tokens=10**30), 400, "max_tokens"),
        BadRequest("max_completion_tokens past the context", CHAT,
                   _json(CHAT_BODY, max_completion_tokens=max_model_len), 400, "max_completion_tokens"),
        BadRequest("temperature below 0", COMPLETIONS, _json(PROMPT, temperature=-0.1), 400, "temperature"),
        BadRequest("temperature NaN", COMPLETIONS, b'{"prompt": "w7", "temperature": NaN}', 400, "temperature"),
        BadRequest("temperature as a string", CHAT, _json(CHAT_BODY, temperature="hot"), 400, "temperature"),
        BadRequest("top_p 0", COMPLETIONS, _json(PROMPT, top_p=0), 400, "top_p"),
        BadRequest("top_p above 1", CHAT, _json(CHAT_BODY, top_p=1.5), 400, "top_p"),
        BadRequest("top_p negative", COMPLETIONS, _json(PROMPT, top_p=-1), 400, "top_p"),
        BadRequest("top_k below -1", COMPLETIONS, _json(PROMPT, top_k=-7), 400, "top_k"),
        BadRequest("seed beyond 64 bits", COMPLETIONS, _json(PROMPT, seed=2**80), 400, "seed"),
        BadRequest("n = 0", CHAT, _json(CHAT_BODY, n=0), 400, "n"),
        BadRequest("structured output a word-level vocabulary cannot spell", CHAT,
                   _json(CHAT_BODY, guided_json={"type": "object"}), 400, "guided_json"),
        BadRequest("structured output with a broken regex", CHAT,
                   _json(CHAT_BODY, structured_outputs={"regex": "a(b"}), 400, "structured_outputs.regex"),
        BadRequest("stop of the wrong type", COMPLETIONS, _json(PROMPT, stop=5), 400, "stop"),
        BadRequest("empty stop string", COMPLETIONS, _json(PROMPT, stop=[""]), 400, "stop"),
        BadRequest("stream as a string", COMPLETIONS, _json(PROMPT, stream="yes"), 400, "stream"),
        BadRequest("logprobs too many", COMPLETIONS, _json(PROMPT, logprobs=50), 400, "logprobs"),
        BadRequest("token id past the vocabulary", COMPLETIONS, _json(PROMPT, prompt=[10, 999_999]), 400, "prompt"),
        BadRequest("token id past 2^31", COMPLETIONS, _json(PROMPT, prompt=[10, 2**40]), 400, "prompt"),
        BadRequest("empty messages", CHAT, _json(CHAT_BODY, messages=[]), 400, "messages"),
        BadRequest("messages as a string", CHAT, _json(CHAT_BODY, messages="hi"), 400, "messages"),
        BadRequest("unknown role", CHAT, _json(CHAT_BODY, messages=[{"role": "wizard", "content": "w7"}]), 400,
                   "messages[0].role"),
        BadRequest("message without content", CHAT, _json(CHAT_BODY, messages=[{"role": "user"}]), 400,
                   "messages[0].content"),
        BadRequest("image content part", CHAT, _json(CHAT_BODY, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages[0].content"),
        BadRequest("prompt longer than max-model-len", COMPLETIONS, _json(PROMPT, prompt=_words(max_model_len + 5)),
                   400, "prompt"),
        BadRequest("messages longer than max-model-len", CHAT,
                   _json(CHAT_BODY, messages=[{"role": "user", "content": _words(max_model_len)}]), 400, "messages"),
        BadRequest("prompt plus max_tokens past the context", COMPLETIONS,
                   _json(PROMPT, prompt=_words(max_model_len - 4), max_tokens=10), 400, "prompt"),
        BadRequest("unknown model", COMPLETIONS, _json(PROMPT, model="gpt-17"), 404, "model"),
        BadRequest("sleep level 3", "/sleep?level=3", b"", 400, "level"),
    ]


def check(http: httpx.Client, request: BadRequest) -> str | None:
    """Send `request`; what is wrong with the answer, or None if it is the right refusal."""
    response = http.post(request.path, content=request.body, headers={"content-type": request.content_type})
    if response.status_code != request.status:
        return f"status {response.status_code}, not {request.status}: {response.text[:300]}"
    problem = openai_error_problem(response)
    if problem:
        return f"{problem}: {response.text[:300]}"
    error = response.json()["error"]
    if error["param"] != request.param:
        return f"param {error['param']!r}, not {request.param!r}: {error['message']}"
    if request.says not in error["message"]:
        return f"the message does not say {request.says!r}: {error['message']}"
    if error["type"] != "invalid_request_error":
        return f"type {error['type']!r}"
    return None
