"""The Responses API's pure parts: its field table (every declared field in it, the docs showing
it), a request as the chat request the router serves, the answer as a response object, the
streamed events in OpenAI's order, and the in-memory store's bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.router.config import ResponsesConfig
from services.router.flows.responses_store import MemoryResponseStore
from services.router.openai.errors import BadRequest
from services.router.openai.protocol_responses import ResponsesRequest
from services.router.openai.responses_events import ResponseEvents
from services.router.openai.responses_fields import RESPONSES_FIELDS, markdown_table, responses_fields
from services.router.openai.responses_objects import StoredResponse
from services.router.openai.responses_translation import (
    ResponseDraft,
    chat_request,
    conversation,
    status_of,
    usage_of,
)

OPENAI_API_DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def draft(body: ResponsesRequest, max_tokens: int = 16) -> ResponseDraft:
    return ResponseDraft(body, "m", 1_700_000_000, max_tokens)


def test_every_declared_field_is_in_the_table_and_the_docs_show_it() -> None:
    assert set(ResponsesRequest.model_fields) == set(responses_fields())
    assert not [field.name for field in RESPONSES_FIELDS if field.status == "refused unless default" and not field.note]
    assert markdown_table() in OPENAI_API_DOC.read_text(), (
        "docs/openai-api.md's responses table is not the code's: python -m services.router.openai.responses_fields")


def test_openais_own_fields_are_each_in_the_table() -> None:
    from openai.types.responses import response_create_params as params

    streaming = params.ResponseCreateParamsStreaming
    assert set(streaming.__required_keys__ | streaming.__optional_keys__) - set(responses_fields()) == set()


@pytest.mark.parametrize("field", [field for field in RESPONSES_FIELDS if field.status == "refused unless default"],
                         ids=lambda field: field.name)
def test_a_refused_field_takes_its_defaults_and_nothing_else(field) -> None:
    for allowed in field.allowed:
        request(**{field.name: allowed})
    with pytest.raises(ValidationError) as refused:
        request(**{field.name: "something else"})
    assert refused.value.errors()[0]["loc"][0] == field.name


def test_instructions_and_input_items_become_the_chat_messages() -> None:
    body = request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Snow"}], tools=[TOOL], temperature=0.3, seed=5)
    chat = chat_request(body, "m", 16, conversation(body.input, None))
    messages = [message.template_message() for message in chat.messages]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    # parts stay parts, as vLLM's server keeps them: the tokenizer joins them (tests/unit/test_model_config.py)
    assert messages[1] == {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                                       {"type": "text", "text": "?"}]}
    assert [call["id"] for call in messages[2]["tool_calls"]] == ["c1", "c2"]  # one assistant turn, two calls
    assert messages[3] == {"role": "tool", "content": "Snow", "tool_call_id": "c1"}
    assert (chat.temperature, chat.seed, chat.max_completion_tokens, chat.chosen_tools) == (0.3, 5, 16, "auto")
    assert chat.tools[0].function.name == "get_weather"


def test_truncation_auto_a_cache_salt_and_template_kwargs_reach_the_chat_as_vllms_fields() -> None:
    body = request(input="Hi", truncation="auto", cache_salt="tenant-a", chat_template_kwargs={"enable_thinking": 0})
    chat = chat_request(body, "m", 8, conversation(body.input, None))
    assert (chat.truncate_prompt_tokens, chat.cache_salt) == (-1, "tenant-a")
    assert chat.template_variables() == {"enable_thinking": 0}
    for truncation in ("disabled", None):
        plain = request(input="Hi", truncation=truncation)
        assert chat_request(plain, "m", 8, conversation(plain.input, None)).truncate_prompt_tokens is None


def test_a_previous_response_starts_the_conversation_without_its_system_messages() -> None:
    first_body = request(instructions="Be brief.", input=[{"role": "system", "content": "old rules"},
                                                          {"role": "user", "content": "Name a river."}])
    first_turn = conversation(first_body.input, None)
    first = draft(first_body).finished("The Seine.", [{"id": "call-9", "type": "function",
                                                       "function": {"name": "f", "arguments": "{}"}}],
                                       "tool_calls", usage_of(10, 3, 0))
    stored = StoredResponse.model_validate_json(StoredResponse(response=first, conversation=first_turn)
                                                .model_dump_json(by_alias=True))
    turn = conversation([{"role": "user", "content": "And a mountain?"}] and "And a mountain?", stored)
    assert [message.template_message() for message in turn] == [
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": "The Seine.", "tool_calls": [
            {"id": "call-9", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "user", "content": "And a mountain?"}]


def test_text_format_and_tool_choice_become_the_chats() -> None:
    schema = {"type": "object"}
    body = request(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    chat = chat_request(body, "m", 8, conversation(body.input, None))
    assert chat.response_format.json_schema.schema_ == schema and chat.response_format.json_schema.name == "x"
    body = request(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"})
    assert chat_request(body, "m", 8, conversation(body.input, None)).chosen_tools == "named"


def test_what_the_chat_refuses_names_the_responses_field() -> None:
    body = request(tools=[TOOL], tool_choice="required", text={"format": {"type": "json_object"}})
    with pytest.raises(BadRequest, match="not both"):
        chat_request(body, "m", 8, conversation(body.input, None))
    body = request(input=[{"role": "assistant", "content": "x"}], tool_choice="required")
    with pytest.raises(BadRequest, match="tool_choice needs tools"):
        chat_request(body, "m", 8, conversation(body.input, None))


def test_the_response_object_says_how_the_answer_ended() -> None:
    body = request(metadata={"k": "v"}, max_output_tokens=4)
    assert status_of("length") == ("incomplete", status_of("length")[1]) and status_of("length")[1].reason == \
        "max_output_tokens"
    assert status_of("stop") == ("completed", None) and status_of("tool_calls") == ("completed", None)
    response = draft(body, 4).finished("", [], "stop", usage_of(7, 0, 3))
    assert response.output == []  # no text: no message item, as vLLM's server answers
    assert response.usage.model_dump() == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3},
                                           "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                                           "total_tokens": 7}
    assert (response.metadata, response.max_output_tokens, response.tool_choice, response.status) == (
        {"k": "v"}, 4, "none", "completed")
    assert draft(body).in_progress().status == "in_progress"


def _events(stream: bytes) -> list[dict]:
    frames = [frame for frame in stream.decode().split("\n\n") if frame]
    parsed = []
    for frame in frames:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        parsed.append(event)
    return parsed


def test_streamed_events_come_in_openais_order_with_sequence_numbers() -> None:
    answer = draft(request(tools=[TOOL]))
    events = ResponseEvents(answer.message_id)
    stream = events.opening(answer.in_progress()) + events.text_delta("") + events.text_delta("Let me ") + \
        events.text_delta("check.")
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}
    stream += events.closing(answer.finished(events.text, [call], "tool_calls", usage_of(5, 4, 0)))
    parsed = _events(stream)
    assert [event["type"] for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [event["sequence_number"] for event in parsed] == list(range(len(parsed)))
    assert parsed[6]["text"] == "Let me check." and parsed[9]["output_index"] == 1
    assert parsed[9]["item"]["arguments"] == "" and parsed[11]["arguments"] == '{"a": 1}'
    assert parsed[-1]["response"]["output"][0]["id"] == parsed[2]["item"]["id"] == answer.message_id


async def test_the_memory_store_drops_the_oldest_past_its_bytes_and_the_expired() -> None:
    now = [0.0]
    stored = [StoredResponse(response=draft(request()).finished("x" * 100, [], "stop", usage_of(1, 1, 0)),
                             conversation=[]) for _ in range(3)]
    size = len(stored[0].model_dump_json(by_alias=True))
    store = MemoryResponseStore(ResponsesConfig(max_bytes=2 * size + 10, max_record_bytes=size, ttl_s=60),
                                lambda: now[0])
    for one in stored:
        assert await store.put(one)
    assert await store.get(stored[0].response.id) is None  # dropped for space
    assert (await store.get(stored[2].response.id)).response == stored[2].response
    big = StoredResponse(response=draft(request()).finished("x" * 200, [], "stop", usage_of(1, 1, 0)),
                         conversation=[])
    assert not await store.put(big)  # larger than a record may be: not stored
    now[0] = 61.0
    assert await store.get(stored[2].response.id) is None  # expired
