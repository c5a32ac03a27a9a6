"""The router reads tool calls as vLLM's own parsers read them, and forces required and
named tool choices into the JSON schemas vLLM's server derives: each checked against
vLLM's code on the same answers and tools (no engine runs)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from transformers import AutoTokenizer  # noqa: E402
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser  # noqa: E402
from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser  # noqa: E402
from vllm.tool_parsers.streaming import extract_required_tool_call_streaming  # noqa: E402
from vllm.tool_parsers.utils import get_json_schema_from_tools  # noqa: E402

from services.router.openai.tool_call_spans import streamed_required_calls  # noqa: E402
from services.router.openai.tool_calls import ToolCalling  # noqa: E402
from services.router.openai.tool_parsers import FORMATS  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": None}}]

HERMES_ANSWERS = [
    "no call at all",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
    'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}',
    "<tool_call>{broken</tool_call>",
    '<tool_call>{"name": "get_time"}</tool_call>',
]
LLAMA_ANSWERS = [
    "plain text",
    '{"name": "get_weather", "parameters": {"city": "Lima"}}',
    '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Pune"}}; {"name": "get_time", "parameters": {}}',
    "a {brace} here",
    '{"city": "Lima"}',
    'Sure: {"name": "get_time", "arguments": {}}',
]


def _request(tool_choice: Any = "auto", parallel: bool | None = True) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 tool_choice=tool_choice, parallel_tool_calls=parallel)


def _theirs(parser: Any, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    found = parser.extract_tool_calls(text, _request())
    calls = [(call.function.name, json.loads(call.function.arguments)) for call in found.tool_calls]
    return (found.content if found.tools_called else text), calls


def _ours(form: str, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    parsed = FORMATS[form].parse(text)
    return parsed.content, [(call.name, json.loads(call.arguments)) for call in parsed.calls]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("text", HERMES_ANSWERS)
def test_hermes_calls_are_read_as_vllm_reads_them(hf_tokenizer: Any, text: str) -> None:
    assert _ours("hermes", text) == _theirs(Hermes2ProToolParser(hf_tokenizer), text)


@pytest.mark.parametrize("text", LLAMA_ANSWERS)
def test_llama3_json_calls_are_read_as_vllm_reads_them(tiny_model_dir: str, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})  # Llama 3's, which it needs
    assert _ours("llama3_json", text) == _theirs(Llama3JsonToolParser(tokenizer), text)


@pytest.mark.parametrize(("tool_choice", "parallel"), [
    ("required", True), ("required", False), ("required", None),
    ({"type": "function", "function": {"name": "get_weather"}}, True),
    ({"type": "function", "function": {"name": "get_time"}}, True),
])
def test_forced_choices_hold_the_answer_to_vllms_schemas(tool_choice: Any, parallel: bool | None) -> None:
    request = _request(tool_choice, parallel)
    theirs = get_json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls)
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    functions = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    ours = ToolCalling("named" if named else "required", functions, named, parallel is not False).forced_schema()
    assert ours == theirs


@pytest.mark.parametrize("text", [
    '[{"name":"get_weather","parameters":{"city":"Oslo","days":7}}]',
    '[{"name": "a", "parameters": {"x": "}]\\""}}, {"name": "b", "parameters": 3}]',
    '[{"name":"a","parameters":{"x":[1,2',
    '[{"name":"a","parameters":{}},{"name":"b"',
    '[{"parameters":{},"name":"a"}]',
    '{"name":"a","parameters":{}}',
    '[{"name":"a","parameters":true ,"x":1}]',
])
def test_a_streamed_required_answer_has_the_calls_vllm_streams(text: str) -> None:
    delta, _ = extract_required_tool_call_streaming(previous_text="", current_text=text, tool_call_idx=None,
                                                    tool_call_id_type="random")
    theirs = [(call.function.name, call.function.arguments) for call in (delta.tool_calls if delta else [])]
    ours = [(call.name, call.arguments) for call in streamed_required_calls(text)]
    assert ours == theirs
