"""The calls of a streamed `tool_choice: required` answer, read as vLLM's server streams
them (pure): the answer is a JSON array of `{"name": ..., "parameters": {...}}`, maybe cut
short; every element whose name is complete and whose parameters have begun is a call, its
arguments the parameters' text as the model wrote it (so far, when cut short).

One pass over the text, aware of strings and nesting, that reads only the array's element
level: braces, brackets and quotes inside values cannot confuse it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.router.openai.tool_parsers import ParsedCall


@dataclass
class _Element:
    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None


class _Scan:
    """The state of the pass: where in the element (`expecting`) and which key's value."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.elements: list[_Element] = []
        self.element: _Element | None = None
        self.expecting = "key"  # key, colon, value, or the value being read: string, container, scalar
        self.key: str | None = None
        self.value_start = 0

    def open_value(self, at: int, kind: str) -> None:
        assert self.element is not None
        self.value_start = at
        if self.key == "parameters":
            self.element.arguments_start = at
        self.expecting = kind

    def close_value(self, at: int) -> None:
        assert self.element is not None
        if self.key == "parameters":
            self.element.arguments_end = at
        elif self.key == "name" and self.expecting == "string":
            try:
                self.element.name = json.loads(self.text[self.value_start:at])
            except ValueError:  # never a call, as the whole answer's parse would refuse it
                self.element.name = None
        self.expecting = "after value"


def streamed_required_calls(text: str) -> list[ParsedCall]:
    scan = _Scan(text)
    depth, in_string, escaped, string_start = 0, False, False, 0
    for at, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 2 and scan.element is not None:
                    if scan.expecting == "key":
                        scan.key, scan.expecting = text[string_start + 1:at], "colon"
                    elif scan.expecting == "string":
                        scan.close_value(at + 1)
            continue
        if char == '"':
            in_string, string_start = True, at
            if depth == 2 and scan.element is not None and scan.expecting == "value":
                scan.open_value(at, "string")
        elif char in "{[":
            if (depth == 0 and char != "[") or (depth == 1 and char != "{"):
                break
            if depth == 1:
                scan.element = _Element()
                scan.elements.append(scan.element)
                scan.expecting, scan.key = "key", None
            elif depth == 2 and scan.element is not None and scan.expecting == "value":
                scan.open_value(at, "container")
            depth += 1
        elif char in "}]":
            if depth == 2 and scan.element is not None and scan.expecting == "scalar":
                scan.close_value(at)
            depth -= 1
            if depth == 2 and scan.element is not None and scan.expecting == "container":
                scan.close_value(at + 1)
            elif depth == 1:
                scan.element = None
            elif depth <= 0:
                break
        elif depth == 2 and scan.element is not None:
            _element_level(scan, at, char)
    return _ready_calls(scan)


def _element_level(scan: _Scan, at: int, char: str) -> None:
    """A character between an element's keys and values (not in a string or a nested value)."""
    if char == ":" and scan.expecting == "colon":
        scan.expecting = "value"
    elif char == ",":
        if scan.expecting == "scalar":
            scan.close_value(at)
        scan.expecting, scan.key = "key", None
    elif char.isspace():
        if scan.expecting == "scalar":
            scan.close_value(at)
    elif scan.expecting == "value":
        scan.open_value(at, "scalar")


def _ready_calls(scan: _Scan) -> list[ParsedCall]:
    calls = []
    for element in scan.elements:
        if element.name is None or element.arguments_start is None:
            break  # elements come in order: none after this one is ready
        end = element.arguments_end if element.arguments_end is not None else len(scan.text)
        calls.append(ParsedCall(element.name, scan.text[element.arguments_start:end]))
    return calls
