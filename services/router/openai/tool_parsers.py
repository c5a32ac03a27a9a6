"""Tool calls written in a model's answer, as vLLM's tool-call parsers read them (pure).

Each format is a `ToolCallFormat`: `parse` reads a whole answer into its text and its calls
(a call's arguments are a JSON string, as the API carries them); `holds_back` tells a
stream where to stop sending text, because a call may begin there. Three formats:

- `hermes` (Hermes 2 Pro, Qwen 2.5 and the tiny model's template): `<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>`, any number, after any text;
- `llama3_json` (Llama 3.x): the answer is JSON objects `{"name": ..., "arguments" or
  "parameters": {...}}`, optionally after `<|python_tag|>`, separated by `;`; any other
  brace that does not open such an object makes the whole answer text;
- `mistral`: text, then `[TOOL_CALLS]` and either a JSON list of calls (tokenizers before
  v11) or `name{arguments}` per marker (v11 on).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None  # None: no text besides the calls
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str) -> ParsedAnswer: ...

    def parse_stream(self, text: str) -> ParsedAnswer:
        """`parse`, for a streamed answer (whose text may already be sent)."""
        ...

    def holds_back(self, text: str) -> int:
        """How many characters at the start of `text` (the answer so far) a stream may send
        as text: the rest may be, or become, a tool call."""
        ...


def _arguments(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call(found: Any, *argument_keys: str) -> ParsedCall:
    """A call from a decoded JSON object; KeyError when it is not one."""
    if not isinstance(found, dict) or not isinstance(found.get("name"), str):
        raise KeyError("name")
    for key in argument_keys:
        if key in found:
            return ParsedCall(found["name"], _arguments(found[key]))
    raise KeyError(argument_keys[0])


def _text_before(text: str, marker: str) -> int:
    """The length of `text` a stream may send when `marker` opens a call: up to the marker,
    and short of any tail that could still grow into it."""
    at = text.find(marker)
    if at >= 0:
        return at
    for overlap in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-overlap:]):
            return len(text) - overlap
    return len(text)


class HermesFormat:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> ParsedAnswer:
        if self.START not in text:
            return ParsedAnswer(text)
        try:
            calls = [_call(json.loads(closed or open_), "arguments") for closed, open_ in self._CALL.findall(text)]
        except (ValueError, KeyError, TypeError):  # not a call after all: the whole answer is text
            return ParsedAnswer(text)
        content = text[:text.find(self.START)]
        return ParsedAnswer(content or None, calls)

    def parse_stream(self, text: str) -> ParsedAnswer:
        return self.parse(text)

    def holds_back(self, text: str) -> int:
        return _text_before(text, self.START)


class Llama3JsonFormat:
    name = "llama3_json"
    TAG = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def parse(self, text: str) -> ParsedAnswer:
        if self.TAG not in text and "{" not in text:
            return ParsedAnswer(text)
        calls: list[ParsedCall] = []
        end = -1
        for match in re.finditer(r"\{", text):
            if match.start() <= end:  # inside an object already read
                continue
            try:
                found, length = self._decoder.raw_decode(text[match.start():])
                calls.append(_call(found, "arguments", "parameters"))
            except (ValueError, KeyError, TypeError):
                return ParsedAnswer(text)
            end = match.start() + length
        return ParsedAnswer(None, calls) if calls else ParsedAnswer(text)

    def parse_stream(self, text: str) -> ParsedAnswer:
        # streamed, only an answer that starts as a call is one (its text was not sent)
        return self.parse(text) if self._starts_as_call(text) else ParsedAnswer(text)

    def _starts_as_call(self, text: str) -> bool:
        return text.startswith(self.TAG) or text.startswith("{")

    def holds_back(self, text: str) -> int:
        # a call is the whole answer: one that starts with the tag or a brace is held back
        if self._starts_as_call(text) or (text and self.TAG.startswith(text)):
            return 0
        return len(text)


class MistralFormat:
    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    _decoder = json.JSONDecoder()

    def parse(self, text: str) -> ParsedAnswer:
        at = text.find(self.MARKER)
        if at < 0:
            return ParsedAnswer(text)
        content = text[:at] or None
        pieces = [piece.strip() for piece in text[at + len(self.MARKER):].split(self.MARKER)]
        try:
            if pieces and pieces[0].startswith("["):  # before v11: one JSON list of calls
                found, _ = self._decoder.raw_decode(pieces[0])
                calls = [_call(entry, "arguments") for entry in found]
            else:  # v11 on: name{arguments} after each marker
                calls = [self._named(piece) for piece in pieces]
        except (ValueError, KeyError, TypeError):
            return ParsedAnswer(text)
        return ParsedAnswer(content, calls)

    def _named(self, piece: str) -> ParsedCall:
        brace = piece.index("{")
        arguments, _ = self._decoder.raw_decode(piece[brace:])
        name = piece[:brace].strip()
        if not name:
            raise KeyError("name")
        return ParsedCall(name, _arguments(arguments))

    def parse_stream(self, text: str) -> ParsedAnswer:
        return self.parse(text)

    def holds_back(self, text: str) -> int:
        return _text_before(text, self.MARKER)


FORMATS: dict[str, ToolCallFormat] = {parser.name: parser for parser in
                                      (HermesFormat(), Llama3JsonFormat(), MistralFormat())}
