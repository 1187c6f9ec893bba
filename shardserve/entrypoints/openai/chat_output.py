"""A chat choice's generated text as an assistant message: its reasoning (reasoning_parsers.py), its content and
its tool calls (tools.py, tool_parsers.py), whole for a response and piece by piece for a stream.

The text goes through two stages: the reasoning parser takes what the model thinks (`reasoning_content`), and
what follows goes to the tool stage of the request's ToolPlan. A stream shows exactly what the whole response
would: the stages hold back only text whose meaning is not known yet (a marker's first characters, a tool call
still being written).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shardserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from shardserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    GenericToolParser,
    ToolCall,
    ToolParser,
    make_tool_call_id,
    tool_parser_for_template,
)
from shardserve.entrypoints.openai.tools import ToolPlan, calls_from_required, tool_call_delta


logger = logging.getLogger(__name__)

TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS, "none")


@dataclass(frozen=True)
class ChatParsers:
    """The server's --tool-call-parser ("auto": the one the chat template's tool format calls for; "none": no
    tool calls read from text) and --reasoning-parser (None: no reasoning split out)."""

    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    def resolve(self, chat_template: str | None) -> tuple[ToolParser | None, ReasoningParser | None]:
        """The tool-call parser ("auto": the template's own format, else the generic one that works with any
        template) and the reasoning parser."""
        name = self.tool_call_parser
        if name == "auto":
            name = tool_parser_for_template(chat_template) or GenericToolParser.name
        tool_parser = TOOL_PARSERS[name]() if name in TOOL_PARSERS else None
        reasoning = REASONING_PARSERS[self.reasoning_parser]() if self.reasoning_parser else None
        logger.info("chat: tool calls read by %s, reasoning %s",
                    f"the {tool_parser.name} parser" if tool_parser else "no parser (tool_choice 'auto' refused)",
                    f"split out by the {reasoning.name} parser" if reasoning else "left in the content")
        return tool_parser, reasoning


@dataclass
class MessageParts:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutput:
    """How the choices of one chat response become messages."""

    def __init__(self, plan: ToolPlan, tool_parser: ToolParser | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        if (plan.mode == "auto" or plan.generic) and tool_parser is None:
            raise ValueError("tool calls written as text need a tool-call parser")
        self.plan = plan
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    @property
    def is_plain(self) -> bool:
        """Whether the message is the text as generated (the renderer's fast path)."""
        return self.plan.mode == "none" and self.reasoning_parser is None

    def message(self, text: str) -> MessageParts:
        reasoning, rest = None, text
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.split(text)
            reasoning, rest = split.reasoning, split.content or ""
        mode = self.plan.mode
        if mode == "none":
            return MessageParts(rest if rest or reasoning is None else None, reasoning)
        if self.plan.generic:
            extracted = self.tool_parser.extract(rest)
            calls = extracted.tool_calls if self.plan.parallel else extracted.tool_calls[:1]
            return MessageParts(extracted.content, reasoning, calls)
        if mode == "named":
            return MessageParts(None, reasoning, [ToolCall(make_tool_call_id(), self.plan.function, rest)])
        if mode == "required":
            calls = calls_from_required(rest)
            return MessageParts(rest, reasoning) if calls is None else MessageParts(None, reasoning, calls)
        extracted = self.tool_parser.extract(rest)
        calls = extracted.tool_calls if self.plan.parallel else extracted.tool_calls[:1]
        return MessageParts(extracted.content, reasoning, calls)

    def finish_reason(self, reason: str | None, called_tools: bool) -> str | None:
        if reason == "stop" and called_tools and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def streamer(self) -> "ChoiceStreamer":
        return ChoiceStreamer(self)


class ChoiceStreamer:
    """One choice's stream: each piece of text in, the delta to send out."""

    def __init__(self, output: ChatOutput) -> None:
        self.plan = output.plan
        self.reasoning = output.reasoning_parser.streamer() if output.reasoning_parser is not None else None
        # The calls read out of text as it streams: "auto", and every mode of the generic format.
        reads_text = self.plan.mode == "auto" or (self.plan.generic and self.plan.mode != "none")
        self.tools = output.tool_parser.streamer() if reads_text else None
        self.calls_sent = 0
        self.named_id: str | None = None  # "named": the call's id, once its first delta went out
        self.held = ""  # "required": the whole array, read at the end

    @property
    def called_tools(self) -> bool:
        return self.calls_sent > 0 or self.named_id is not None

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The parts of the next delta (reasoning_content, content, tool_calls), those that are set."""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if finished:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        else:
            reasoning, content = "", text
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        content, calls = self._tool_stage(content, finished)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _tool_stage(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        mode = self.plan.mode
        if mode == "none":
            return text, []
        if self.tools is not None:
            piece = self.tools.feed(text)
            content, calls = piece.content, list(piece.tool_calls)
            if finished:
                rest = self.tools.finish()
                content, calls = content + rest.content, calls + list(rest.tool_calls)
            return content, self._whole(calls)
        if mode == "named":
            if self.named_id is None and (text or finished):
                self.named_id = make_tool_call_id()
                return "", [tool_call_delta(0, self.named_id, self.plan.function, text)]
            return "", [tool_call_delta(0, arguments=text)] if text else []
        if mode == "required":
            self.held += text
            if not finished:
                return "", []
            calls = calls_from_required(self.held)
            return (self.held, []) if calls is None else ("", self._whole(calls))
        raise AssertionError(f"tool_choice mode {mode!r} reads no calls from text")

    def _whole(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """Complete calls as deltas, numbered on from those sent; past the first when calls may not be parallel
        the rest are dropped (as in the whole response)."""
        entries = []
        for call in calls:
            if self.calls_sent >= 1 and not self.plan.parallel:
                break
            entries.append(tool_call_delta(self.calls_sent, call.id, call.name, call.arguments))
            self.calls_sent += 1
        return entries
