"""Tool calls read from outputs written as Qwen2.5/Qwen3 (hermes) and Llama 3.1 (llama3_json) write them, and
in shardserve's generic format.

The fact a client relies on: a stream, however the text is split into pieces (inside markers too), ends with
the same content and calls as the whole output read at once; since a stream cannot take back what it sent,
that also means no marker or call JSON ever went out as content.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from shardserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    make_tool_call_id,
    tool_parser_for_template,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'

# Outputs as Qwen2.5/Qwen3 produce them, and what they hold: (content, [(name, arguments as parsed JSON)]).
HERMES_OUTPUTS = {
    "one call": (WEATHER, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    "two calls": (
        WEATHER + "\n" + TIME,
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    "text then a call": (
        "I'll check the current weather in Paris for you.\n\n" + WEATHER,
        "I'll check the current weather in Paris for you.",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "unicode arguments": (
        '<tool_call>\n{"name": "translate", "arguments": {"text": "Ça coûte 5 €", "target": "日本語"}}\n</tool_call>',
        None,
        [("translate", {"text": "Ça coûte 5 €", "target": "日本語"})],
    ),
    "nested arguments, markers inside strings": (
        ('<tool_call>\n{"name": "run_query", "arguments": {"filter": {"and": [{"tag": "a}b"}, {"n": [1, 2, {}]}]},'
         ' "note": "ends with </tool_call> and {braces}", "quote": "say \\"}\\""}}\n</tool_call>'),
        None,
        [("run_query", {"filter": {"and": [{"tag": "a}b"}, {"n": [1, 2, {}]}]},
                        "note": "ends with </tool_call> and {braces}", "quote": 'say "}"'})],
    ),
    "arguments already a string": (
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "no closing tag at eos": (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
        "Checking.",
        [("get_weather", {"city": "Paris"})],
    ),
    "text between and after calls": (
        "First Paris.\n" + WEATHER + "\nThen the time.\n" + TIME + "\n",
        "First Paris.\n\nThen the time.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    "plain answer": ("The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    "malformed JSON stays content": (
        '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',
        [],
    ),
    "cut short by max_tokens": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    "no name": (
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        [],
    ),
    "the tag mentioned in prose, then a call": (
        "Calls go in <tool_call> tags, like this:\n" + WEATHER,
        "Calls go in <tool_call> tags, like this:",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "a bad call then a good one": (
        '<tool_call>\n{"name": "oops"}\n</tool_call>\n' + TIME,
        '<tool_call>\n{"name": "oops"}\n</tool_call>',
        [("get_time", {"timezone": "Europe/Paris"})],
    ),
    "only whitespace": ("\n\n", None, []),
}

# Outputs as Llama 3.1 produces them.
LLAMA_OUTPUTS = {
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
                 [("get_weather", {"city": "Paris"})]),
    "python tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
                   [("get_weather", {"city": "Paris"})]),
    "two calls, semicolon": (
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'),
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    "two calls, newline, 'arguments' key": (
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time", "parameters": {}}\n',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    "leading whitespace, unicode, nested": (
        '\n{"name": "search", "parameters": {"q": "café }", "filters": {"langs": ["fr", "de"]}}}',
        None,
        [("search", {"q": "café }", "filters": {"langs": ["fr", "de"]}})],
    ),
    "plain answer": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "plain answer that mentions JSON": ('Use {"name": "x"} as input.', 'Use {"name": "x"} as input.', []),
    "JSON answer without a name": ('{"city": "Paris", "population": 2102650}',
                                   '{"city": "Paris", "population": 2102650}', []),
    "JSON answer with a name but no parameters": ('{"name": "Paris", "country": "France"}',
                                                  '{"name": "Paris", "country": "France"}', []),
    "cut short by max_tokens": ('{"name": "get_weather", "parameters": {"city": "Pa',
                                '{"name": "get_weather", "parameters": {"city": "Pa', []),
    "built-in tool call (not JSON)": ('<|python_tag|>brave_search.call(query="Paris weather")',
                                      '<|python_tag|>brave_search.call(query="Paris weather")', []),
    "a call, then text": (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\nI will tell you when I know.',
        "I will tell you when I know.",
        [("get_weather", {"city": "Paris"})],
    ),
}

# Outputs in the generic format, as its grammar lays them out.
GENERIC_OUTPUTS = {
    "one call": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', None,
                 [("get_weather", {"city": "Paris"})]),
    "two calls": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                  '{"name": "get_time", "arguments": {}}]}', None,
                  [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "an answer": ('{"response": "It is sunny in Paris."}', "It is sunny in Paris.", []),
    "an answer with escapes": ('{"response": "say \\"hi\\"\\n\\u00e9 \\ud83d\\ude00 \\\\ end"}',
                               'say "hi"\né 😀 \\ end', []),
    "an answer whose text looks like a call": ('{"response": "{\\"tool_calls\\": []}"}', '{"tool_calls": []}', []),
    "an answer in a response_format's schema": ('{"response": {"city": "Paris", "n": [1, 2]}}',
                                                '{"city": "Paris", "n": [1, 2]}', []),
    "an answer cut short by max_tokens": ('{"response": "It is sun', "It is sun", []),
    "an answer cut inside an escape": ('{"response": "caf\\u00', "caf", []),
    "calls cut short by max_tokens": ('{"tool_calls": [{"name": "get_weather", "argu',
                                      '{"tool_calls": [{"name": "get_weather", "argu', []),
}

CASES = [("hermes", name, *case) for name, case in HERMES_OUTPUTS.items()] + [
    ("llama3_json", name, *case) for name, case in LLAMA_OUTPUTS.items()
] + [("generic", name, *case) for name, case in GENERIC_OUTPUTS.items()]
CASE_IDS = [f"{parser}: {name}" for parser, name, *_ in CASES]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def stream(parser_name: str, pieces: list[str]) -> tuple[str | None, list[ToolCall]]:
    """Content and calls sent, streaming `pieces` through a fresh streamer."""
    streamer = TOOL_PARSERS[parser_name]().streamer()
    deltas = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    calls = [call for delta in deltas for call in delta.tool_calls]
    assert streamer.called_tools == bool(calls)
    return "".join(delta.content for delta in deltas) or None, calls


def splits(text: str, seed: int) -> list[list[str]]:
    """`text` in two pieces at every position, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    result = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        result.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return result


@pytest.mark.parametrize("parser_name, name, text, content, calls", CASES, ids=CASE_IDS)
def test_extract_reads_recorded_outputs(parser_name, name, text, content, calls):
    extracted = TOOL_PARSERS[parser_name]().extract(text)
    assert isinstance(extracted, ExtractedToolCalls)
    assert extracted.content == content
    assert calls_of(extracted.tool_calls) == calls


@pytest.mark.parametrize("parser_name, name, text, content, calls", CASES, ids=CASE_IDS)
def test_stream_split_anywhere_ends_as_extract(parser_name, name, text, content, calls):
    for pieces in splits(text, seed=len(text)):
        streamed_content, streamed_calls = stream(parser_name, pieces)
        assert (streamed_content, calls_of(streamed_calls)) == (content, calls), pieces


def test_arguments_are_json_text_with_unicode_kept():
    call = TOOL_PARSERS["hermes"]().extract(HERMES_OUTPUTS["unicode arguments"][0]).tool_calls[0]
    assert call.arguments == '{"text": "Ça coûte 5 €", "target": "日本語"}'


def test_content_before_a_call_streams_at_once_and_the_call_arrives_whole_at_its_closing_tag():
    streamer = TOOL_PARSERS["hermes"]().streamer()
    assert streamer.feed("Let me check").content == "Let me check"
    assert streamer.feed(" the weather.\n<tool").content == " the weather."  # "<tool" might open a call
    assert streamer.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_') == StreamDelta()
    delta = streamer.feed("call>")
    assert (delta.content, calls_of(delta.tool_calls)) == ("", [("get_weather", {"city": "Paris"})])
    assert streamer.called_tools
    assert streamer.finish().tool_calls == ()


def test_a_held_back_lookalike_goes_out_once_it_cannot_be_a_marker():
    streamer = TOOL_PARSERS["hermes"]().streamer()
    assert streamer.feed("if a <").content == "if a"
    assert streamer.feed("tool").content == ""
    assert streamer.feed(" b").content == " <tool b"
    assert not streamer.called_tools


def test_llama_call_streams_once_its_object_closes_and_text_once_it_cannot_be_a_call():
    streamer = TOOL_PARSERS["llama3_json"]().streamer()
    assert streamer.feed('{"name": "get_weather", "parameters": {"city": "Paris"}').tool_calls == ()
    assert calls_of(streamer.feed("}").tool_calls) == [("get_weather", {"city": "Paris"})]
    text = TOOL_PARSERS["llama3_json"]().streamer()
    assert text.feed("<|py").content == ""
    assert text.feed("thon is a language").content == "<|python is a language"


def test_every_call_gets_its_own_openai_style_id():
    ids = [make_tool_call_id() for _ in range(100)]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", id_) for id_ in ids)
    assert len(set(ids)) == len(ids)
    calls = TOOL_PARSERS["hermes"]().extract(HERMES_OUTPUTS["two calls"][0]).tool_calls
    assert calls[0].id != calls[1].id


# Short but faithful excerpts of the real chat templates' tool sections.
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- endif %}'
)
HERMES2_TEMPLATE = (
    "{{- 'Use the following pydantic model json schema for each tool call you will make: ' }}"
    "{{- 'For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\\n' }}{{- '<tool_call>\\n' }}"
)
LLAMA31_TEMPLATE = (
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if builtin_tools is defined or tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its"
    " value}.' }}\n"
    "            {{- '<|python_tag|>' + tool_call.name + '.call(' }}\n"
)
LLAMA_JSON_FORMAT_ONLY = (
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its"
    " value}.' }}"
)
LLAMA_PYTHON_TAG_ONLY = "{%- if tool_call.name in builtin_tools %}{{- '<|python_tag|>' + tool_call.name }}"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template, parser", [
    (QWEN25_TEMPLATE, "hermes"),
    (HERMES2_TEMPLATE, "hermes"),
    (LLAMA31_TEMPLATE, "llama3_json"),
    ("{%- if tools is not none %}{{- \"Environment: ipython\\n\" }}{%- endif %}", "llama3_json"),
    (LLAMA_JSON_FORMAT_ONLY, "llama3_json"),
    (LLAMA_PYTHON_TAG_ONLY, "llama3_json"),
    (CHATML_TEMPLATE, None),
    ("", None),
    (None, None),
], ids=["qwen2.5", "hermes-2-pro", "llama-3.1", "ipython only", "json format only", "python tag only", "chatml",
        "empty", "none"])
def test_tool_parser_for_template(template, parser):
    assert tool_parser_for_template(template) == parser
    assert parser is None or parser in TOOL_PARSERS


def test_a_generic_answer_streams_as_it_is_written():
    streamer = TOOL_PARSERS["generic"]().streamer()
    assert streamer.feed('{"resp') == StreamDelta()
    assert streamer.feed('onse": "It is') == StreamDelta("It is")
    assert streamer.feed(" sunny") == StreamDelta(" sunny")
    assert streamer.feed(' \\ud83d') == StreamDelta()  # a surrogate pair's first half waits for the second
    assert streamer.feed('\\ude00"}') == StreamDelta(" 😀")
    assert streamer.finish() == StreamDelta()
