"""Tools, tool calls and tool results in the prompt, for every chat template.

A model's chat template may lay out the tools a request offers, the calls an assistant message made and the
results tool messages carry; or some of these; or none (SmolLM2's, Llama 2's, most base chat templates).
`TemplateCaps.probe` finds out which, once per template, by rendering probe conversations. What the template
does not lay out, `ChatPrompter` writes into the messages before the template renders them, in the tool format
the server reads back (`ToolFormat`), so the model always sees its tools, what it called and what came back:

- the tools: an instruction listing them (name, description, parameters schema) and the format to call them
  in, added to the system message (or, where the template has no system role, to the first user message);
- an earlier call: the assistant's text, written exactly as the model must write a call;
- a result: a `tool` message where the template renders that role, else a user message naming its tool
  (joined to the user message before it, for templates that insist on alternating roles).

The template's own layout is used wherever it has one for the format the server reads: tools go to the
template only then, since a template's tool instructions for another format would contradict the one
enforced. A message's null content reaches the template as "" (templates concatenate it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardserve.entrypoints.openai.tool_parsers import tool_parser_for_template
from shardserve.entrypoints.openai.tools import ToolPlan

logger = logging.getLogger(__name__)

# Render(messages, tools) -> the prompt's text; raises when the template refuses the conversation.
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


# --------------------------------------------------------------------------- what a template lays out

_PROBE_NAME = "probe_tool_q7x"
_PROBE_ARGUMENT = "probe_argument_k3v"
_PROBE_RESULT = "probe_result_z9w"
_PROBE_SYSTEM = "probe_system_m2j"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe", "parameters": {
        "type": "object", "properties": {_PROBE_ARGUMENT: {"type": "string"}}, "required": [_PROBE_ARGUMENT]}}}
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME,
                                                                      "arguments": {_PROBE_ARGUMENT: "x"}}}


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template lays out itself."""

    tools: bool  # the tools passed to it
    tool_calls: bool  # an assistant message's tool_calls
    tool_role: bool  # a "tool" message's content
    system_role: bool  # a system message's content

    @classmethod
    def probe(cls, render: Render) -> TemplateCaps:
        user = {"role": "user", "content": "hi"}
        calling = {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]}
        tools = _shows(render, [user], [_PROBE_TOOL], _PROBE_NAME)
        tool_calls = _shows(render, [user, calling], None, _PROBE_ARGUMENT)
        answered = calling if tool_calls else {"role": "assistant", "content": "ok"}
        result = {"role": "tool", "tool_call_id": "call_probe", "name": _PROBE_NAME, "content": _PROBE_RESULT}
        return cls(tools=tools, tool_calls=tool_calls,
                   tool_role=_shows(render, [user, answered, result], None, _PROBE_RESULT),
                   system_role=_shows(render, [{"role": "system", "content": _PROBE_SYSTEM}, user], None,
                                      _PROBE_SYSTEM))


def _shows(render: Render, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, mark: str) -> bool:
    try:
        return mark in render(messages, tools)
    except Exception:  # a template that refuses the probe does not lay it out
        return False


# --------------------------------------------------------------------------- tool formats


def _function_list(tools: list[dict[str, Any]]) -> str:
    """The tools as the instruction lists them: one JSON object a line."""
    lines = []
    for tool in tools:
        function = tool["function"]
        entry = {"name": function["name"]}
        if function.get("description"):
            entry["description"] = function["description"]
        entry["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)


def _calls_object(calls: list[dict[str, Any]], arguments_key: str) -> list[dict[str, Any]]:
    return [{"name": c["function"]["name"], arguments_key: c["function"]["arguments"]} for c in calls]


class ToolFormat:
    """How one tool-call format is explained to a model and how calls and results are written in it."""

    name: str

    def instructions(self, plan: ToolPlan) -> str:
        """What the model is told of its tools (plan.tools) and how to call them."""
        raise NotImplementedError

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """An assistant's calls (in the template's shape: arguments as objects) as the model writes them."""
        raise NotImplementedError

    def result_text(self, name: str | None, content: str) -> str:
        """A tool result, for templates that have no tool role (it goes in a user message)."""
        return json.dumps({"tool_response": {"name": name, "content": content}}, ensure_ascii=False)


_USE_RESULTS = ("Call a function only for what you do not know yet. Once a function's result is in the conversation, "
                "answer the user with it.")


def _what_to_do(plan: ToolPlan, call: str, answer: str = "") -> str:
    """How to call (and, with "auto", how to answer otherwise), as the plan allows."""
    which = "one or more of these functions" if plan.parallel else "one of these functions"
    if plan.mode == "named":
        return f"Call the function {plan.function}, in this format:\n{call}"
    if plan.mode == "required":
        return f"Call {which}, in this format:\n{call}"
    return f"To call {which}, answer in this format:\n{call}\n{answer}".rstrip()


class GenericFormat(ToolFormat):
    """shardserve's own format, for any model: one JSON object, enforced by the grammar (tools.py)."""

    name = "generic"

    def instructions(self, plan: ToolPlan) -> str:
        call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
        answer = 'To answer without calling a function, answer in this format:\n{"response": "<your answer>"}'
        return (f"You can call these functions (their arguments are JSON schemas):\n{_function_list(plan.tools)}"
                f"\n\n{_what_to_do(plan, call, answer)}\n{_USE_RESULTS}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return json.dumps({"tool_calls": _calls_object(calls, "arguments")}, ensure_ascii=False)


class HermesFormat(ToolFormat):
    name = "hermes"

    def instructions(self, plan: ToolPlan) -> str:
        call = '<tool_call>\n{"name": "<function name>", "arguments": {<its arguments>}}\n</tool_call>'
        return (f"You can call functions. Their signatures, within <tools></tools> tags:\n<tools>\n"
                f"{_function_list(plan.tools)}\n</tools>\n\n{_what_to_do(plan, call)}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>"
                         for c in _calls_object(calls, "arguments"))

    def result_text(self, name: str | None, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"

    def instructions(self, plan: ToolPlan) -> str:
        call = '{"name": "<function name>", "parameters": {<its arguments>}}'
        return (f"You can call these functions (their parameters are JSON schemas):\n{_function_list(plan.tools)}"
                f"\n\n{_what_to_do(plan, call)}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps(c, ensure_ascii=False) for c in _calls_object(calls, "parameters"))


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (GenericFormat(), HermesFormat(), Llama3JsonFormat())}


# --------------------------------------------------------------------------- the prompt


@dataclass(frozen=True)
class ChatPrompter:
    """Prepares a conversation (messages in the template's shape) and its tools for one chat template.

    `tool_format`: the format tool calls are read back in (None: none are read; earlier calls are still shown,
    in the generic format). `native_tools`: the template lays out tools in that very format itself.
    """

    caps: TemplateCaps
    tool_format: ToolFormat | None
    native_tools: bool

    @classmethod
    def for_template(cls, chat_template: str | None, render: Render, tool_format: ToolFormat | None
                     ) -> ChatPrompter:
        caps = TemplateCaps.probe(render) if chat_template else TemplateCaps(False, False, False, False)
        native = (caps.tools and tool_format is not None
                  and tool_format.name == tool_parser_for_template(chat_template))
        prompter = cls(caps, tool_format, native)
        logger.info("chat template: %s", prompter.describe())
        return prompter

    def describe(self) -> str:
        """One line for the start-up log: who writes what into the prompt."""
        fmt = self._writer.name
        own = [part for part, native in (("the tools", self.native_tools), ("earlier calls", self._native_calls))
               if native]
        written = [part for part in ("the tools", "earlier calls") if part not in own]
        said = [f"the template lays out {' and '.join(own)}"] if own else []
        if written:
            said.append(f"shardserve writes {' and '.join(written)} in the {fmt} format")
        said.append(f"tool results go as {'tool' if self.caps.tool_role else 'user'} messages")
        return "; ".join(said)

    @property
    def _native_calls(self) -> bool:
        return self.native_tools and self.caps.tool_calls

    @property
    def _writer(self) -> ToolFormat:
        return self.tool_format or TOOL_FORMATS["generic"]

    def prepare(self, messages: list[dict[str, Any]], plan: ToolPlan
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools for the template), for a request whose tools ask for `plan` (plan.tools: those
        the model is offered, none when tool_choice is "none")."""
        names = {call["id"]: call["function"]["name"] for m in messages for call in m.get("tool_calls") or ()}
        prepared: list[dict[str, Any]] = []
        for message in messages:
            message = {**message, "content": message.get("content") or ""}
            if message.get("tool_calls") and not self._native_calls:
                calls = self._writer.calls_text(message.pop("tool_calls"))
                message["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
            if message["role"] == "tool" and not self.caps.tool_role:
                result = self._writer.result_text(names.get(message.get("tool_call_id")), message["content"])
                if prepared and prepared[-1]["role"] == "user":
                    prepared[-1] = {**prepared[-1], "content": f"{prepared[-1]['content']}\n\n{result}"}
                    continue
                message = {"role": "user", "content": result}
            prepared.append(message)
        if not plan.tools:
            return prepared, None
        if self.native_tools:
            return prepared, plan.tools
        return self._with_instructions(prepared, self._writer.instructions(plan)), None

    def _with_instructions(self, messages: list[dict[str, Any]], instructions: str) -> list[dict[str, Any]]:
        first = messages[0] if messages else None
        if self.caps.system_role:
            if first is not None and first["role"] == "system":
                return [{**first, "content": f"{first['content']}\n\n{instructions}"}, *messages[1:]]
            return [{"role": "system", "content": instructions}, *messages]
        # No system role: the instructions open the first user message.
        at = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if at is None:
            return [{"role": "user", "content": instructions}, *messages]
        user = messages[at]
        return [*messages[:at], {**user, "content": f"{instructions}\n\n{user['content']}"}, *messages[at + 1:]]
