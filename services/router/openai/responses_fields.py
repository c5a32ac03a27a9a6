"""Every request field of `/v1/responses`, and what Tandem does with it. Pure.

The same rule as the generate endpoints' table (`request_fields`): each field OpenAI's API or
vLLM's server (0.32, `vllm/entrypoints/openai/responses/protocol.py`) defines is honoured, has
no effect in vLLM's server either, or is refused with a 400 naming it unless it has one of
its accepted values; any other field is a 400 naming it. vLLM's extensions refused here for
the same reason as on the generate endpoints are their rows, taken from `request_fields`.
`protocol_responses` builds its request model from this table, and docs/openai-api.md shows
`markdown_table()` (a test keeps them equal).
"""

from __future__ import annotations

import json

from services.router.openai.request_fields import Origin, RequestField, Status, fields_of

ENDPOINT = "responses"


def _field(name: str, status: Status, note: str = "", origin: Origin = "vllm") -> RequestField:
    return RequestField(name, status, ("responses",), (None,), note, origin)


def _refused(name: str, *allowed: object, why: str, origin: Origin = "vllm") -> RequestField:
    return RequestField(name, "refused unless default", ("responses",), allowed or (None,), why, origin)


_PASSED_TO_CHAT = "as the chat endpoint takes it"

_HONOURED = [
    _field("model", "honoured", "absent: the router's own model"),
    _field("input", "honoured", "a string, or items: messages (text or input_text / output_text / "
                                "input_image parts: an image as a data URL), function_call and function_call_output"),
    _field("instructions", "honoured", "a system message first; not carried on by previous_response_id"),
    _field("max_output_tokens", "honoured"),
    _field("previous_response_id", "honoured", "the stored response's conversation and output start this one"),
    _field("store", "honoured", "stored in a NATS key-value bucket every router replica reads, for the "
                                "router's --responses-ttl; false: nothing stored"),
    _field("stream", "honoured", "OpenAI's events with sequence numbers"),
    _field("text", "honoured", "format: text, json_object or json_schema (the router's structured output)"),
    _field("tools", "honoured", "function tools; built-in tools (web_search, file_search, ...) are refused"),
    _field("tool_choice", "honoured", "none, auto (needs the router's --tool-call-parser), required or "
                                      "a named function"),
    _field("parallel_tool_calls", "honoured", "false: at most one call"),
    _field("metadata", "honoured", "echoed and stored: up to 16 string pairs"),
    _field("truncation", "honoured", "auto: a conversation longer than the context keeps its last tokens (the "
                                     "context length less one), as vLLM's server cuts it; disabled (or absent): "
                                     "a 400"),
    *(_field(name, "honoured", _PASSED_TO_CHAT) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
        "structured_outputs", "priority", "cache_salt", "chat_template_kwargs")),
]

_NO_EFFECT = [
    _field("user", "no effect", "an end-user id for the client's own records; echoed"),
    _field("prompt_cache_key", "no effect", "vLLM's server ignores it too: the prefix cache needs no key"),
]

_NO_REASONING = "no reasoning parser in the router: an answer is never split into reasoning and content"
_DEFAULT_IMAGE_PROCESSING = ("the router places each image's tokens as the model's processor does by default: "
                             "other settings would place them otherwise")
_NOT_IMPLEMENTED = "not implemented"

_REFUSED = [
    _refused("background", None, False, why="responses run in the request that created them"),
    _refused("include_stop_str_in_output", None, False, why="a response's text ends before its stop string"),
    _refused("include", None, [], why="no extra output data is implemented (logprobs, reasoning, tool results)"),
    _refused("reasoning", None, why=_NO_REASONING),
    _refused("include_reasoning", None, True, why=_NO_REASONING),
    _refused("max_tool_calls", None, why="the router runs no tools itself: a function call ends the response"),
    _refused("prompt", None, why="no stored prompt templates"),
    _refused("service_tier", None, "auto", "default", why="one tier: the router's admission and priority"),
    _refused("top_logprobs", None, 0, why="log-probabilities are not implemented for responses"),
    _refused("conversation", None, why="conversations are not stored: use previous_response_id", origin="openai"),
    _refused("context_management", None, why=_NOT_IMPLEMENTED, origin="openai"),
    _refused("prompt_cache_retention", None, why="the workers' prefix caches evict by use", origin="openai"),
    _refused("safety_identifier", None, why=_NOT_IMPLEMENTED, origin="openai"),
    _refused("stream_options", None, why="no stream obfuscation is implemented", origin="openai"),
    _refused("background_options", None, why="responses run in the request that created them", origin="openai"),
    _refused("prompt_cache_options", None, why="the workers' prefix caches evict by use", origin="openai"),
    _refused("access_programs", None, why=_NOT_IMPLEMENTED, origin="openai"),
    _refused("moderation", None, why="no moderation is implemented", origin="openai"),
    _refused("image", None, why="no image generation: Tandem serves text", origin="openai"),
    _refused("enable_response_messages", None, False, why=_NOT_IMPLEMENTED),
    _refused("previous_input_messages", None, why="harmony messages are not served: use previous_response_id"),
    _refused("media_io_kwargs", None, why=_DEFAULT_IMAGE_PROCESSING),
    _refused("mm_processor_kwargs", None, why=_DEFAULT_IMAGE_PROCESSING),
    _refused("mm_payload", None, "tensors", why="images come as input_image parts (data URLs), not as tensors"),
    _refused("return_mm_kwargs", None, why=_NOT_IMPLEMENTED),
    _refused("request_id", None, why="the router names each response itself"),
    *fields_of("responses").values(),  # the generate endpoints' rows that name this one too (`request_fields.EVERY`)
]

RESPONSES_FIELDS: tuple[RequestField, ...] = (*_HONOURED, *_NO_EFFECT, *_REFUSED)


def responses_fields(status: Status | None = None) -> dict[str, RequestField]:
    return {field.name: field for field in RESPONSES_FIELDS if status is None or field.status == status}


def markdown_table() -> str:
    """The table of `/v1/responses` docs/openai-api.md shows."""
    rows = ["| field | status | note |", "|---|---|---|"]
    for field in sorted(RESPONSES_FIELDS, key=lambda field: (field.status != "honoured", field.status, field.name)):
        note = field.note
        if field.status == "refused unless default":
            accepted = ", ".join("absent" if value is None else json.dumps(value) for value in field.allowed)
            note = f"accepted: {accepted}; {note}"
        rows.append(f"| `{field.name}` | {field.status} | {note} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
