"""Reasoning told apart from the answer in outputs written as Qwen3 and DeepSeek-R1 write them.

The fact a client relies on: a stream, however the text is split into pieces (inside `<think>` and
`</think>` too), ends with the same reasoning and content as the whole output split at once; since a stream
cannot take back what it sent, that also means no marker ever went out as reasoning or content.
"""

from __future__ import annotations

import random

import pytest

from shardserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningSplit

QWEN3_THINKING = (
    "<think>\nThe user asks for the capital of France. That is Paris.\n</think>\n\nParis is the capital of France."
)
DEEPSEEK_R1 = "Okay, so the user asks what 2 + 2 is. That's 4.\n</think>\n\nThe answer is 4."

# (parser, output, reasoning, content) for complete outputs.
CASES = {
    "qwen3 thinking": ("qwen3", QWEN3_THINKING,
                       "The user asks for the capital of France. That is Paris.", "Paris is the capital of France."),
    "qwen3 thinking off": ("qwen3", "Paris is the capital of France.", None, "Paris is the capital of France."),
    "qwen3 empty reasoning": ("qwen3", "<think>\n\n</think>\n\nHi", None, "Hi"),
    "qwen3 reasoning, no answer": ("qwen3", "<think>\nHmm.\n</think>\n\n", "Hmm.", None),
    "qwen3 tags inside an answer": ("qwen3", "Write <think> and </think> around it.",
                                    None, "Write <think> and </think> around it."),
    "qwen3 tool call after thinking": (
        "qwen3", ('<think>\nI need the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Paris"}}\n</tool_call>'),
        "I need the weather.", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "qwen3 empty output": ("qwen3", "", None, None),
    "deepseek_r1": ("deepseek_r1", DEEPSEEK_R1, "Okay, so the user asks what 2 + 2 is. That's 4.", "The answer is 4."),
    "deepseek_r1 with <think> (R1-0528)": ("deepseek_r1", "<think>\nOkay, 2 + 2 = 4.\n</think>\n\nIt is 4.",
                                          "Okay, 2 + 2 = 4.", "It is 4."),
    "deepseek_r1 cut short": ("deepseek_r1", "Okay, so the user asks what 2 + 2", "Okay, so the user asks what 2 + 2",
                              None),
    "deepseek_r1 answer keeps its own whitespace": ("deepseek_r1", "Fine.</think>  Four\n\n  spaces  \n",
                                                    "Fine.", "Four\n\n  spaces  \n"),
}


def stream(parser_name: str, pieces: list[str]) -> tuple[str | None, str | None]:
    streamer = REASONING_PARSERS[parser_name]().streamer()
    sent = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    reasoning = "".join(piece for piece, _ in sent)
    content = "".join(piece for _, piece in sent)
    return reasoning or None, content or None


def splits(text: str, seed: int) -> list[list[str]]:
    """`text` in two pieces at every position, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    result = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        result.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return result


@pytest.mark.parametrize("parser_name, text, reasoning, content", CASES.values(), ids=CASES.keys())
def test_split_reads_recorded_outputs(parser_name, text, reasoning, content):
    assert REASONING_PARSERS[parser_name]().split(text) == ReasoningSplit(reasoning, content)


@pytest.mark.parametrize("parser_name, text, reasoning, content", CASES.values(), ids=CASES.keys())
def test_stream_split_anywhere_ends_as_split(parser_name, text, reasoning, content):
    for pieces in splits(text, seed=len(text)):
        assert stream(parser_name, pieces) == (reasoning, content), pieces


def test_qwen3_unclosed_think_streams_as_reasoning_but_splits_as_content():
    text = "<think>\nThe user asks for a long essay. Let me plan it: first"
    assert REASONING_PARSERS["qwen3"]().split(text) == ReasoningSplit(None, text)
    assert stream("qwen3", [text[:10], text[10:]]) == ("The user asks for a long essay. Let me plan it: first", None)


def test_reasoning_and_content_stream_as_they_come():
    streamer = REASONING_PARSERS["qwen3"]().streamer()
    assert not streamer.in_reasoning
    assert streamer.feed("<th") == ("", "")
    assert streamer.feed("ink>\nThe user") == ("The user", "")
    assert streamer.in_reasoning
    assert streamer.feed(" asks.\n</th") == (" asks.", "")  # "\n</th" might close the reasoning
    assert streamer.feed("ink>\n\n") == ("", "")
    assert not streamer.in_reasoning
    assert streamer.feed("Paris") == ("", "Paris")
    assert streamer.feed(" is.\n") == ("", " is.\n")
    assert streamer.finish() == ("", "")


def test_qwen3_answer_without_thinking_streams_as_content_at_once():
    streamer = REASONING_PARSERS["qwen3"]().streamer()
    assert streamer.feed("Paris") == ("", "Paris")
    assert not streamer.in_reasoning


def test_deepseek_r1_starts_in_reasoning():
    streamer = REASONING_PARSERS["deepseek_r1"]().streamer()
    assert streamer.in_reasoning
    assert streamer.feed("Okay, so") == ("Okay, so", "")
    assert streamer.feed("</think>\n\nFour.") == ("", "Four.")
    assert not streamer.in_reasoning
