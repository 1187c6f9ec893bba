"""Tool calls read out of generated text, whole or as it streams, for the chat API's `tool_calls`.

Three formats: two named as vLLM names them, and shardserve's own for models whose template has none:

- `hermes` (Qwen2.5, Qwen3, Hermes 2/3): each call is a JSON object between tags, possibly after some text,
  several in a row:

      Let me check.
      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  A last `<tool_call>` whose JSON is complete counts even without its closing tag (the model stopped at eos).
- `llama3_json` (Llama 3.1/3.2/3.3): the whole output is one or more objects
  `{"name": "get_weather", "parameters": {"city": "Paris"}}`, optionally after `<|python_tag|>`, separated by
  `;` or newlines. Only an output that starts with `{` or `<|python_tag|>` holds calls; any other is text.

- `generic` (any model; the tool_prompts module tells the model of it, and the grammar enforces it): the whole
  output is one JSON object, either `{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}`
  or `{"response": "the answer"}`, whose string streams out as content while it is written.

Text that does not read as a call stays content, never an error: a `<tool_call>` not followed by a valid call
(its JSON malformed or cut short) is plain text, and so is a Llama output whose first object is not a call.
`arguments` is always JSON text, as OpenAI sends `function.arguments`.

Both formats are read by one streaming state machine per choice (`ToolCallStreamer`); `extract` feeds it
the whole text at once, so a stream, however it is split, ends with the same content and calls as `extract`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import ClassVar

_ID_ALPHABET = string.ascii_letters + string.digits
# A JSON string (its closing quote missing while it is still streaming) or a bracket outside strings.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\]]', re.DOTALL)


def make_tool_call_id() -> str:
    """A tool call id in OpenAI's shape: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ExtractedToolCalls:
    content: str | None  # the text that is not a tool call; None when nothing but whitespace remains
    tool_calls: list[ToolCall]  # empty: the output was plain text


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""  # text to send now as delta.content
    tool_calls: tuple[ToolCall, ...] = ()  # tool calls completed by this piece, each sent whole


class ToolCallStreamer:
    """Per-choice streaming state: `feed` each piece of generated text, then `finish` once.

    Text is held back (`_held`) only while it could still be, or be part of, a tool call. Whitespace after
    the last content sent is held too (`_blank`): it goes out with the next content, or at the end of an
    answer that called no tool, so the gaps between and after tool calls never reach the client.
    """

    def __init__(self) -> None:
        self._held = ""
        self._blank = ""
        self._said_text = False
        self._called = False
        self._pieces: list[str] = []
        self._calls: list[ToolCall] = []

    @property
    def called_tools(self) -> bool:
        return self._called

    def feed(self, delta_text: str) -> StreamDelta:
        self._held += delta_text
        return self._step(at_end=False)

    def finish(self) -> StreamDelta:
        delta = self._step(at_end=True)
        tail = self._blank if self._said_text and not self._called else ""
        self._blank = ""
        return StreamDelta(delta.content + tail, delta.tool_calls)

    def _step(self, at_end: bool) -> StreamDelta:
        self._pieces, self._calls = [], []
        self._advance(at_end)
        return StreamDelta("".join(self._pieces), tuple(self._calls))

    def _advance(self, at_end: bool) -> None:
        """Consume `_held` as far as it is decided, through `_say` and `_call`; at_end: all of it."""
        raise NotImplementedError

    def _say(self, text: str) -> None:
        """Send `text` as content, all but its trailing whitespace (held in `_blank`)."""
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body):]
        if body:
            self._pieces.append(body)
            self._said_text = True

    def _call(self, call: ToolCall) -> None:
        self._calls.append(call)
        self._called = True


class ToolParser:
    """One model family's tool-call format."""

    name: ClassVar[str]

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and tool calls of a whole output."""
        streamer = self.streamer()
        first, last = streamer.feed(text), streamer.finish()
        content = first.content + last.content
        return ExtractedToolCalls(content or None, [*first.tool_calls, *last.tool_calls])

    def streamer(self) -> ToolCallStreamer:
        raise NotImplementedError


# --------------------------------------------------------------------------- shared reading


def _held_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the beginning of `marker` (and not all of it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object opened at text[start] ("{"); None while it has not closed.

    Brackets are matched outside strings only, so `}` or `</tool_call>` inside a string value is skipped.
    The object's JSON is checked afterwards: this only finds where it would end.
    """
    depth = 0
    for token in _JSON_TOKEN.finditer(text, start):
        bracket = token.group()
        if bracket == "{" or bracket == "[":
            depth += 1
        elif bracket == "}" or bracket == "]":
            depth -= 1
            if depth == 0:
                return token.end()
    return None


def _call_from_json(text: str) -> ToolCall | None:
    """The call that `{"name": ..., "arguments" (or "parameters"): ...}` stands for; None if it is none."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):  # missing, or not an object: not a call
        return None
    return ToolCall(make_tool_call_id(), obj["name"], arguments)


# --------------------------------------------------------------------------- hermes

_CALL_OPEN = "<tool_call>"
_CALL_CLOSE = "</tool_call>"


def _read_tagged_call(body: str, at_end: bool) -> tuple[int, ToolCall | None] | None:
    """The call that `body` (the text after an opening <tool_call>) begins with.

    (n, call): the call and its closing tag are body[:n]; (0, None): this is no call, the opening tag is
    plain text; None: undecided until more text arrives.
    """
    start = len(body) - len(body.lstrip())
    if start == len(body):
        return (0, None) if at_end else None
    if body[start] != "{":
        return 0, None
    end = _object_end(body, start)
    if end is None:
        return (0, None) if at_end else None
    call = _call_from_json(body[start:end])
    if call is None:
        return 0, None
    rest = body[end:].lstrip()
    if rest.startswith(_CALL_CLOSE):
        return len(body) - len(rest) + len(_CALL_CLOSE), call
    if _CALL_CLOSE.startswith(rest):  # nothing yet, or part of the closing tag
        return (len(body), call) if at_end else None
    return 0, None


class _HermesStreamer(ToolCallStreamer):
    def __init__(self) -> None:
        super().__init__()
        self._in_call = False  # `_held` is the text after an opening <tool_call>

    def _advance(self, at_end: bool) -> None:
        while True:
            if not self._in_call:
                opened = self._held.find(_CALL_OPEN)
                if opened < 0:
                    keep = 0 if at_end else _held_marker_len(self._held, _CALL_OPEN)
                    self._say(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    return
                self._say(self._held[:opened])
                self._held = self._held[opened + len(_CALL_OPEN):]
                self._in_call = True
            read = _read_tagged_call(self._held, at_end)
            if read is None:
                return
            length, call = read
            if call is None:
                self._say(_CALL_OPEN)  # reading resumes right after the tag
            else:
                self._call(call)
                self._held = self._held[length:]
            self._in_call = False


class HermesToolParser(ToolParser):
    name = "hermes"

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer()


# --------------------------------------------------------------------------- llama3_json

_PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


class _Llama3JsonStreamer(ToolCallStreamer):
    def __init__(self) -> None:
        super().__init__()
        # "start": the output's first characters are not known yet; "calls": reading objects from
        # `_held[_next:]`; "text": the rest of the output is content.
        self._mode = "start"
        self._next = 0

    def _advance(self, at_end: bool) -> None:
        if self._mode == "start":
            head = self._held.lstrip()
            if not at_end and len(head) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(head):
                return
            if head.startswith((_PYTHON_TAG, "{")):
                self._mode = "calls"
                self._next = self._held.find(_PYTHON_TAG) + len(_PYTHON_TAG) if head[0] == "<" else 0
            else:
                self._mode = "text"
        while self._mode == "calls":
            start = len(self._held) - len(self._held[self._next:].lstrip(_SEPARATORS))
            opens = self._held.startswith("{", start)
            end = _object_end(self._held, start) if opens else None
            if not at_end and (start == len(self._held) or (opens and end is None)):
                return  # the next object has not begun, or not ended
            call = _call_from_json(self._held[start:end]) if end is not None else None
            if call is not None:
                self._call(call)
                self._held, self._next = self._held[end:], 0
            else:
                # The output ends, or goes on with something that is not a call: before any call the whole
                # output is text, after one what is left of it.
                self._held = self._held[start:] if self._called else self._held
                self._mode = "text"
        if self._mode == "text":
            self._say(self._held)
            self._held = ""


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def streamer(self) -> ToolCallStreamer:
        return _Llama3JsonStreamer()


# --------------------------------------------------------------------------- generic

RESPONSE_OPENING = '{"response": "'  # the grammar's fixed layout: no whitespace but ", " and ": "
# The longest start of a JSON string's body that decodes whole: no escape cut in two.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\[^u])*')
# A string body ending in the escape of a surrogate pair's first half (\ud800 to \udbff).
_HIGH_SURROGATE_AT_END = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


def _decoded_string(body: str) -> str:
    return json.loads(f'"{body}"')


class _GenericStreamer(ToolCallStreamer):
    """A `{"response": "..."}` output streams its string as it is written, decoded; any other output (the tool
    calls, or a response that is not a string) is read whole at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # then "response" (`_held` is the string's body so far), "after" or "whole"

    def _advance(self, at_end: bool) -> None:
        if self._mode == "start":
            if self._held.startswith(RESPONSE_OPENING):
                self._mode, self._held = "response", self._held[len(RESPONSE_OPENING):]
            elif RESPONSE_OPENING.startswith(self._held) and not at_end:
                return
            else:
                self._mode = "whole"
        if self._mode == "response":
            body = _STRING_BODY.match(self._held).group()
            closed = self._held.startswith('"', len(body))
            if not closed and _HIGH_SURROGATE_AT_END.search(body):
                body = body[:-6]  # the first half of a pair: wait for the second
            self._say(_decoded_string(body))
            self._held = self._held[len(body):]
            if closed or at_end:  # at the end without its quote: cut short, and said as far as it went
                self._mode, self._held = "after", ""
        elif self._mode == "after":
            self._held = ""
        elif self._mode == "whole" and at_end:
            self._read_whole()

    def _read_whole(self) -> None:
        text, self._held = self._held, ""
        try:
            whole = json.loads(text)
        except ValueError:
            whole = None
        calls = whole.get("tool_calls") if isinstance(whole, dict) else None
        read = [_call_from_json(json.dumps(c)) for c in calls] if isinstance(calls, list) else []
        if read and all(read):
            for call in read:
                self._call(call)
        elif isinstance(whole, dict) and "response" in whole and not isinstance(whole["response"], str):
            self._say(json.dumps(whole["response"], ensure_ascii=False))
        else:
            self._say(text)  # not the format (cut short by max_tokens): the text as written


class GenericToolParser(ToolParser):
    name = "generic"

    def streamer(self) -> ToolCallStreamer:
        return _GenericStreamer()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, GenericToolParser)
}

# Llama 3.1's instruction: 'Respond in the format {"name": function name, "parameters": dictionary of ...}'
# (its quotes may be escaped where the template writes it in a double-quoted string).
_LLAMA_CALL_FORMAT = re.compile(r'\{\\?"name\\?":[^{}]*\\?"parameters\\?":')


def tool_parser_for_template(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format calls for: 'hermes' for templates that tell the model to answer
    in <tool_call> tags (Qwen2.5, Qwen3, Hermes), 'llama3_json' for Llama 3.1/3.2/3.3 templates (they mention
    <|python_tag|> or "Environment: ipython" or ask for {"name": ..., "parameters": ...}); None when the
    template shows no tool format."""
    if not chat_template:
        return None
    if _CALL_OPEN in chat_template:
        return HermesToolParser.name
    if (_PYTHON_TAG in chat_template or "Environment: ipython" in chat_template
            or _LLAMA_CALL_FORMAT.search(chat_template)):
        return Llama3JsonToolParser.name
    return None
