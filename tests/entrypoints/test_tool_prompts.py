"""Tools, calls and results reach the prompt whatever the chat template lays out itself: probed per template,
written by shardserve where the template has nothing, left to the template where it has the format read back."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from shardserve.entrypoints.openai.tool_prompts import TOOL_FORMATS, ChatPrompter, TemplateCaps
from shardserve.entrypoints.openai.tools import ToolDefinition, tool_plan
from shardserve.tokenizer import Tokenizer
from tests.tiny_models import TOOLS_CHAT_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
LOOP = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
# Llama 2's rules: no tool role, no system role of its own here, and roles that must alternate.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('only user and assistant roles') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def _render(template: str):
    """A chat template's renderer, as a Tokenizer over it runs it."""
    hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    hf.chat_template = template
    return Tokenizer(hf, [0], "probe").chat_text


def _plan(**choice):
    return tool_plan([ToolDefinition.model_validate(WEATHER)], choice.get("tool_choice"),
                     choice.get("parallel_tool_calls"), generic=True)


@pytest.fixture(scope="module")
def smollm2_render(smollm2_gguf):
    return Tokenizer.from_model_path(smollm2_gguf).chat_text


def test_probes_find_what_each_template_lays_out(smollm2_render):
    assert TemplateCaps.probe(smollm2_render) == TemplateCaps(tools=False, tool_calls=False, tool_role=True,
                                                              system_role=True)
    assert TemplateCaps.probe(_render(TOOLS_CHAT_TEMPLATE)) == TemplateCaps(True, True, True, True)
    assert TemplateCaps.probe(_render(STRICT_TEMPLATE)) == TemplateCaps(False, False, False, False)


def test_a_template_without_tools_gets_them_calls_and_results_in_the_generic_format(smollm2_render):
    prompter = ChatPrompter.for_template("any", smollm2_render, TOOL_FORMATS["generic"])
    messages, tools = prompter.prepare(LOOP, _plan())
    assert tools is None  # the template would drop them
    prompt = smollm2_render(messages, tools)
    assert prompt.startswith("<|im_start|>system\nYou can call these functions")
    assert json.dumps({"name": "get_weather", **{k: WEATHER["function"][k] for k in ("description", "parameters")}}) in prompt
    assert 'To call one of these functions' in prompt  # one call: parallel_tool_calls was not asked for
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in prompt
    assert "<|im_start|>tool\n18 degrees<|im_end|>" in prompt
    # The client's own system message keeps its place and gains the instructions.
    messages, _ = prompter.prepare([{"role": "system", "content": "Be brief."}, *LOOP], _plan(tool_choice="required"))
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert "Call one of these functions" in messages[0]["content"]


def test_tool_choice_none_still_shows_the_history_but_not_the_tools(smollm2_render):
    prompter = ChatPrompter.for_template("any", smollm2_render, TOOL_FORMATS["generic"])
    messages, tools = prompter.prepare(LOOP, _plan(tool_choice="none"))
    prompt = smollm2_render(messages, tools)
    assert "You can call" not in prompt and '{"tool_calls": [{"name": "get_weather"' in prompt
    assert "18 degrees" in prompt


def test_a_template_with_the_format_read_back_lays_everything_out_itself():
    render = _render(TOOLS_CHAT_TEMPLATE)
    prompter = ChatPrompter.for_template(TOOLS_CHAT_TEMPLATE, render, TOOL_FORMATS["hermes"])
    assert prompter.native_tools
    plan = tool_plan([ToolDefinition.model_validate(WEATHER)], None, None)
    messages, tools = prompter.prepare(LOOP, plan)
    assert messages == LOOP and tools == plan.tools
    # Asked to read another format, the server writes the tools itself: the template's instructions would
    # contradict the format enforced.
    generic = ChatPrompter.for_template(TOOLS_CHAT_TEMPLATE, render, TOOL_FORMATS["generic"])
    messages, tools = generic.prepare(LOOP, _plan())
    assert messages[0]["role"] == "system" and tools is None
    assert messages[2]["content"].startswith('{"tool_calls": [') and "tool_calls" not in messages[2]


def test_a_template_without_tool_or_system_roles_gets_user_messages_that_alternate():
    render = _render(STRICT_TEMPLATE)
    prompter = ChatPrompter.for_template(STRICT_TEMPLATE, render, TOOL_FORMATS["generic"])
    second = {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": {}}}
    loop = [*LOOP[:1], {"role": "assistant", "content": None, "tool_calls": [CALL, second]}, LOOP[2],
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    messages, tools = prompter.prepare(loop, _plan())
    prompt = render(messages, tools)  # the template raised on any other role, or on two user turns in a row
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert prompt.startswith("[user] You can call these functions")
    results = messages[2]["content"].split("\n\n")
    assert [json.loads(r)["tool_response"] for r in results] == [
        {"name": "get_weather", "content": "18 degrees"}, {"name": "get_time", "content": "noon"}]


def test_each_format_writes_calls_its_parser_reads_back():
    from shardserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

    second = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    for name, fmt in TOOL_FORMATS.items():
        read = TOOL_PARSERS[name]().extract(fmt.calls_text([CALL, second]))
        assert [(c.name, json.loads(c.arguments)) for c in read.tool_calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})], name
        assert read.content is None, name


@pytest.mark.parametrize("name, marker, call", [
    ("hermes", "<tool_call>", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("llama3_json", '"parameters": {<its arguments>}', '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
def test_a_parser_named_for_a_template_without_tools_still_puts_the_tools_in_the_prompt(smollm2_render, name,
                                                                                        marker, call):
    # --tool-call-parser hermes on SmolLM2: its template would drop the tools, so shardserve writes them, with the
    # instructions of the format the parser reads, and earlier calls in that format.
    prompter = ChatPrompter.for_template("any", smollm2_render, TOOL_FORMATS[name])
    plan = tool_plan([ToolDefinition.model_validate(WEATHER)], None, None)
    messages, tools = prompter.prepare(LOOP, plan)
    prompt = smollm2_render(messages, tools)
    system = prompt.split("<|im_start|>user")[0]
    assert '"name": "get_weather", "description": "Current weather in a city"' in system and marker in system
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
