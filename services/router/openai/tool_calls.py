"""One chat request's tool calling, as vLLM's server does it (pure).

`tool_choice` decides the answer's shape:
- none: plain text (the tools are still shown to the template);
- auto: the model may call; calls are read from its text in the router's tool-call format
  (`tool_parsers`), and the answer ends with `tool_calls` when it made one;
- required: the answer is forced (structured output) into a JSON list of
  `{"name", "parameters"}`, one entry per call, `anyOf` the tools; it ends with `tool_calls`;
- a named function: the answer is forced into that function's arguments; one call, and
  the answer ends as it ended (`stop`, `length`), as OpenAI's does.

A stream sends the text a call cannot be part of as it comes, and the calls whole at the
end, which OpenAI clients assemble as they assemble vLLM's argument pieces. As vLLM's
server streams them, a streamed required answer's calls are the array's elements begun
(`tool_call_spans`: arguments as written, even if cut short), where the whole answer has
calls only if the array is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from services.router.openai.tool_call_spans import streamed_required_calls
from services.router.openai.tool_parsers import ParsedCall, ToolCallFormat

ToolUse = Literal["none", "auto", "required", "named"]
# formats whose markers are special tokens: a tool request keeps special tokens in the text
KEEPS_SPECIAL_TOKENS = ("hermes", "mistral")


@dataclass(frozen=True)
class ToolAnswer:
    content: str | None
    calls: list[dict[str, Any]]  # as the API spells them: id, type, function {name, arguments}
    finish_reason: str


def _api_call(call: ParsedCall) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


@dataclass
class ToolCalling:
    use: ToolUse
    functions: dict[str, dict[str, Any] | None]  # name -> its parameters' schema
    named: str | None = None
    parallel: bool = True
    form: ToolCallFormat | None = None  # the router's tool-call format (auto needs one)

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer is held to (required, named), None otherwise."""
        if self.use == "named":
            assert self.named is not None
            return _parameters_schema(self.functions[self.named])
        if self.use != "required":
            return None
        entries = [{"properties": {"name": {"type": "string", "enum": [name]},
                                   "parameters": _parameters_schema(parameters)},
                    "required": ["name", "parameters"]} for name, parameters in self.functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": entries}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def answer(self, text: str, finish_reason: str, *, streamed: bool = False) -> ToolAnswer:
        """The whole answer's text and calls, read from the text the model wrote."""
        if self.use == "named":
            calls = [ParsedCall(self.named or "", text)] if text.strip() else []
            return self._answer("", calls, finish_reason)
        if self.use == "required" and streamed:  # each call as it was streamed, even if the list is cut short
            calls = streamed_required_calls(text)
            return self._answer("", calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason)
        if self.use == "required":
            calls = _listed_calls(text)
            return self._answer("", calls, "tool_calls" if finish_reason == "stop" else finish_reason)
        if self.use == "auto" and self.form is not None:
            parsed = self.form.parse(text) if not streamed else self.form.parse_stream(text)
            if parsed.calls:
                content = parsed.content if parsed.content and parsed.content.strip() else None
                return self._answer(content, parsed.calls, "tool_calls")
        return ToolAnswer(text, [], finish_reason)

    def _answer(self, content: str | None, calls: list[ParsedCall], finish_reason: str) -> ToolAnswer:
        kept = calls if self.parallel else calls[:1]
        return ToolAnswer(content, [_api_call(call) for call in kept], finish_reason)

    def sendable(self, text: str) -> int:
        """How much of the answer so far a stream may send as text now."""
        if self.use in ("named", "required"):
            return 0
        if self.use == "auto" and self.form is not None:
            return self.form.holds_back(text)
        return len(text)


def _listed_calls(text: str) -> list[ParsedCall]:
    """A required choice's JSON list of calls; anything else (cut short, say) is no call."""
    try:
        listed = json.loads(text)
    except ValueError:
        return []
    if not isinstance(listed, list) or not all(isinstance(entry, dict) and isinstance(entry.get("name"), str)
                                               for entry in listed):
        return []
    return [ParsedCall(entry["name"], json.dumps(entry.get("parameters"), ensure_ascii=False)) for entry in listed]


@dataclass
class ToolStream:
    """A streamed answer's text, held back where a call may begin."""

    calling: ToolCalling
    text: str = ""
    sent: int = 0

    def add(self, piece: str) -> str:
        """The text to send now, `piece` having come."""
        self.text += piece
        sendable = self.calling.sendable(self.text)
        out = self.text[self.sent:sendable] if sendable > self.sent else ""
        self.sent = max(self.sent, sendable)
        return out

    def finish(self, piece: str, finish_reason: str) -> tuple[str, ToolAnswer]:
        """The text still to send and the answer, its last `piece` having come."""
        self.text += piece
        answer = self.calling.answer(self.text, finish_reason, streamed=True)
        if answer.calls:
            rest = (answer.content or "")[self.sent:]
        else:
            rest = self.text[self.sent:] if self.calling.use not in ("named", "required") else ""
        return rest, answer
