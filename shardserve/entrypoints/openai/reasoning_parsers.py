r"""The reasoning part of a generated text told apart from its answer, whole or as it streams.

Two formats, named as vLLM names them, both marking the reasoning with `<think>` ... `</think>`:

- `qwen3` (Qwen3 with thinking on): the output opens the reasoning itself,
  `<think>\nThe user asks...\n</think>\n\nParis is the capital.`; with thinking off (the template puts an
  empty `<think>\n\n</think>` in the prompt) the output is the answer alone, without tags. Reasoning is only
  what follows a leading `<think>`: an output that does not begin with it is all content, streamed as it comes
  (reading a later `</think>` as the end of a reasoning part would hold back every thinking-off answer until
  it ends; outputs that begin inside the reasoning are deepseek_r1's).
- `deepseek_r1` (DeepSeek-R1, and templates that end the prompt with `<think>`, as QwQ's and Qwen3's -2507
  thinking models' do): the output begins inside the reasoning, `Okay, so...\n</think>\n\nThe answer is 4.`
  (a leading `<think>` is dropped). No `</think>`: everything is reasoning.

The reasoning is stripped of the whitespace around it and is None when empty; the content is what follows
`</think>` less its leading whitespace (Qwen3 emits `</think>\n\n`), None when empty.

A stream gives the same reasoning and content as `split` of the whole output, except in one case: a qwen3
output that opens `<think>` and never closes it (stopped by max_tokens, say) streams as reasoning, since the
end is unknown while it streams, but splits as content (there was no complete reasoning part), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None when the output had no reasoning part (or an empty one)
    content: str | None  # None when nothing follows the reasoning


class ReasoningStreamer:
    """Per-choice streaming state: `feed` each piece of generated text, then `finish` once.

    It moves through "start" (whether the output opens with `<think>` is not known yet), "reasoning",
    "after" (past `</think>`, dropping the whitespace that follows) and "content". `_held` is text not yet
    sent: a possible beginning of a marker, or the whitespace being decided on. Whitespace after the reasoning
    sent so far waits in `_blank`: it goes out only if more reasoning follows.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self._start, self._end = parser.start, parser.end
        self._opened_by_prompt = parser.opened_by_prompt
        self._state = "start"
        self._held = ""
        self._blank = ""
        self._said_reasoning = False

    @property
    def in_reasoning(self) -> bool:
        """Still inside the reasoning part (for qwen3, known once the leading `<think>` has arrived)."""
        return self._state == "reasoning" or (self._state == "start" and self._opened_by_prompt)

    def feed(self, delta_text: str) -> tuple[str, str]:
        """(reasoning, content) to send now for this piece; either may be ""."""
        self._held += delta_text
        return self._advance(at_end=False)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back until the end of generation."""
        return self._advance(at_end=True)

    def _advance(self, at_end: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == "start":
            head = self._held.lstrip()
            if not at_end and len(head) < len(self._start) and self._start.startswith(head):
                return "", ""
            if head.startswith(self._start):
                self._held, self._state = head[len(self._start):], "reasoning"
            else:
                self._state = "reasoning" if self._opened_by_prompt else "content"
        if self._state == "reasoning":
            closed = self._held.find(self._end)
            if closed < 0:
                keep = 0 if at_end else _held_marker_len(self._held, self._end)
                reasoning = self._reason(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                return reasoning, ""
            reasoning = self._reason(self._held[:closed])
            self._held, self._state = self._held[closed + len(self._end):], "after"
        if self._state == "after":
            self._held = self._held.lstrip()
            if not self._held:
                return reasoning, ""
            self._state = "content"
        content, self._held = self._held, ""
        return reasoning, content

    def _reason(self, text: str) -> str:
        """The part of this reasoning text to send now: none of its leading or (so far) trailing whitespace."""
        text = self._blank + text
        if not self._said_reasoning:
            text = text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body):]
        self._said_reasoning = self._said_reasoning or bool(body)
        return body


class ReasoningParser:
    """One model family's reasoning format."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # The chat template opens the reasoning in the prompt, so the output begins inside it.
    opened_by_prompt: ClassVar[bool] = False

    def split(self, text: str) -> ReasoningSplit:
        """The reasoning and content of a whole output."""
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start):]
        elif self.opened_by_prompt:
            body = text
        else:
            return ReasoningSplit(None, text or None)
        reasoning, closed, content = body.partition(self.end)
        if not closed:
            if self.opened_by_prompt:
                return ReasoningSplit(body.strip() or None, None)
            return ReasoningSplit(None, text or None)  # streamed, this is reasoning: see the module docstring
        return ReasoningSplit(reasoning.strip() or None, content.lstrip() or None)

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opened_by_prompt = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def _held_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the beginning of `marker` (and not all of it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
