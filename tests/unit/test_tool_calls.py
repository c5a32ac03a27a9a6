"""Tool calls read from answers (each format), the form a forced tool choice puts on the
answer, and a streamed answer held back where a call may begin."""

from __future__ import annotations

import json

import pytest

from services.router.config import TOOL_CALL_FORMATS
from services.router.openai.tool_calls import ToolCalling, ToolStream
from services.router.openai.tool_parsers import FORMATS, ParsedCall

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = {"get_weather": WEATHER, "get_time": None}


def test_the_router_config_names_exactly_the_formats_there_are() -> None:
    assert set(TOOL_CALL_FORMATS) == set(FORMATS)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("just text", "just text", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', None,
     [ParsedCall("get_weather", '{"city": "Zürich"}')]),
    ('Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": {"x": 1}}</tool_call>', "Let me look. ", [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')]),
    ('<tool_call>{"name": "a", "arguments": {"x": 1}}', None, [ParsedCall("a", '{"x": 1}')]),  # cut short: read to the end
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"name": "a"}</tool_call>', '<tool_call>{"name": "a"}</tool_call>', []),  # no arguments
])
def test_hermes_calls_are_read_after_any_text(text: str, content: str | None, calls: list[ParsedCall]) -> None:
    parsed = FORMATS["hermes"].parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("no call here", "no call here", []),
    ('{"name": "get_time", "parameters": {}}', None, [ParsedCall("get_time", "{}")]),
    ('<|python_tag|>{"name": "a", "arguments": {"x": [1, {"y": 2}]}}; {"name": "b", "parameters": {"z": "é"}}',
     None, [ParsedCall("a", '{"x": [1, {"y": 2}]}'), ParsedCall("b", '{"z": "é"}')]),
    ("set {x} = 1", "set {x} = 1", []),  # a brace that opens no call: all text
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON without a name
])
def test_llama3_json_calls_are_the_whole_answer(text: str, content: str | None, calls: list[ParsedCall]) -> None:
    parsed = FORMATS["llama3_json"].parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("plain", "plain", []),
    ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', None,
     [ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")]),
    ('Sure.[TOOL_CALLS]get_weather{"city": "Oslo"}[TOOL_CALLS]get_time{}', "Sure.",
     [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("get_time", "{}")]),
    ("[TOOL_CALLS]broken", "[TOOL_CALLS]broken", []),
])
def test_mistral_calls_follow_their_marker(text: str, content: str | None, calls: list[ParsedCall]) -> None:
    parsed = FORMATS["mistral"].parse(text)
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize(("form", "text", "sendable"), [
    ("hermes", "Hello", 5),
    ("hermes", "Hello <tool", 6),  # may become <tool_call>
    ("hermes", "Hello <tooth", 12),
    ("hermes", "Hi <tool_call>{", 3),
    ("llama3_json", "Hello {", 7),  # streamed, a call is the whole answer
    ("llama3_json", '{"name', 0),
    ("llama3_json", "<|py", 0),
    ("mistral", "Ok [TOOL", 3),
])
def test_a_stream_holds_back_only_what_may_be_a_call(form: str, text: str, sendable: int) -> None:
    assert FORMATS[form].holds_back(text) == sendable


def test_a_named_choice_forces_the_functions_arguments_and_makes_one_call() -> None:
    calling = ToolCalling("named", FUNCTIONS, "get_weather")
    assert calling.forced_schema() == WEATHER
    answer = calling.answer('{"city": "Lima"}', "stop")
    assert answer.content == "" and answer.finish_reason == "stop"  # as OpenAI's: a named call ends with stop
    [call] = answer.calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert ToolCalling("named", FUNCTIONS, "get_time").forced_schema() == {"type": "object", "properties": {}}
    assert ToolCalling("named", FUNCTIONS, "get_weather").answer("  ", "length").calls == []


def test_a_required_choice_forces_a_list_of_calls_and_ends_with_tool_calls() -> None:
    schema = ToolCalling("required", FUNCTIONS).forced_schema()
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [entry["properties"]["name"]["enum"] for entry in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert ToolCalling("required", FUNCTIONS, parallel=False).forced_schema()["maxItems"] == 1
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}])
    answer = ToolCalling("required", FUNCTIONS).answer(text, "stop")
    assert [call["function"] for call in answer.calls] == [{"name": "get_weather", "arguments": '{"city": "Rome"}'},
                                                           {"name": "get_time", "arguments": "{}"}]
    assert answer.finish_reason == "tool_calls" and answer.content == ""
    assert len(ToolCalling("required", FUNCTIONS, parallel=False).answer(text, "stop").calls) == 1
    cut = ToolCalling("required", FUNCTIONS).answer(text[:20], "length")  # cut short: no call, said so
    assert cut.calls == [] and cut.finish_reason == "length"


def test_auto_reads_calls_in_the_routers_format_and_none_leaves_the_text() -> None:
    text = 'I will check.<tool_call>{"name": "get_weather", "arguments": {"city": "Kyiv"}}</tool_call>'
    answer = ToolCalling("auto", FUNCTIONS, form=FORMATS["hermes"]).answer(text, "stop")
    assert answer.content == "I will check." and answer.finish_reason == "tool_calls" and len(answer.calls) == 1
    plain = ToolCalling("auto", FUNCTIONS, form=FORMATS["hermes"]).answer("no call", "length")
    assert (plain.content, plain.calls, plain.finish_reason) == ("no call", [], "length")
    untouched = ToolCalling("none", FUNCTIONS).answer(text, "stop")
    assert (untouched.content, untouched.calls, untouched.finish_reason) == (text, [], "stop")


def test_a_stream_sends_text_as_it_comes_and_the_calls_whole_at_the_end() -> None:
    stream = ToolStream(ToolCalling("auto", FUNCTIONS, form=FORMATS["hermes"]))
    pieces = ["Checking", " now <to", 'ol_call>{"name": "get_weather", ', '"arguments": {"city": "Nice"}}']
    sent = [stream.add(piece) for piece in pieces]
    assert sent == ["Checking", " now ", "", ""]
    rest, answer = stream.finish("</tool_call>", "stop")
    assert rest == "" and answer.content == "Checking now " and answer.finish_reason == "tool_calls"
    assert answer.calls[0]["function"]["arguments"] == '{"city": "Nice"}'

    no_call = ToolStream(ToolCalling("auto", FUNCTIONS, form=FORMATS["hermes"]))
    assert no_call.add("a <to") == "a "
    assert no_call.finish("y box", "stop")[0] == "<toy box"  # held back, then sent as text

    forced = ToolStream(ToolCalling("named", FUNCTIONS, "get_weather"))
    assert forced.add('{"city"') == ""
    rest, answer = forced.finish(': "Bern"}', "stop")
    assert rest == "" and answer.calls[0]["function"]["arguments"] == '{"city": "Bern"}'


@pytest.mark.parametrize(("text", "calls"), [
    ('[{"name":"get_weather","parameters":{"city":"Oslo","days":7}}]', [ParsedCall("get_weather", '{"city":"Oslo","days":7}')]),
    ('[{"name": "a", "parameters": {"x": "}]\\""}}, {"name": "b", "parameters": 3}]',
     [ParsedCall("a", '{"x": "}]\\""}'), ParsedCall("b", "3")]),
    ('[{"name":"a","parameters":{"x":[1,2', [ParsedCall("a", '{"x":[1,2')]),  # cut short: as written so far
    ('[{"name":"a","parameters":{}},{"name":"b"', [ParsedCall("a", "{}")]),  # b's parameters not begun
    ('[{"parameters":{},"name":"a"}]', [ParsedCall("a", "{}")]),
    ('{"name":"a","parameters":{}}', []),  # not an array
])
def test_a_streamed_required_answer_has_every_call_begun(text: str, calls: list[ParsedCall]) -> None:
    answer = ToolCalling("required", FUNCTIONS).answer(text, "length", streamed=True)
    assert [ParsedCall(c["function"]["name"], c["function"]["arguments"]) for c in answer.calls] == calls
