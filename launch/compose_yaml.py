"""A small YAML writer for the generated compose file (`launch.compose`): nested dicts as
block mappings, lists of plain values in flow style (`["router", "--port", "8000"]`), other
lists as block sequences, strings always double-quoted (JSON escapes are valid YAML), so
no value can be misread (`on`, `8000:8000`, `${VAR}`). Pure: no I/O, no dependency.
"""

from __future__ import annotations

import json
import re

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
Scalar = str | int | float | bool | None


def to_yaml(value: object) -> str:
    """`value` (a dict) as YAML text, ending in a newline."""
    if not isinstance(value, dict):
        raise TypeError("the document must be a mapping")
    return "".join(_mapping(value, 0))


def _scalar(value: Scalar) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _key(key: object) -> str:
    text = str(key)
    return text if _PLAIN_KEY.fullmatch(text) and text not in ("true", "false", "null", "yes", "no", "on", "off") \
        else json.dumps(text)


def _flat(value: object) -> bool:
    return isinstance(value, list) and all(not isinstance(item, dict | list) for item in value)


def _mapping(mapping: dict, depth: int) -> list[str]:
    pad = "  " * depth
    lines: list[str] = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{_key(key)}:\n")
            lines += _mapping(value, depth + 1)
        elif isinstance(value, dict):
            lines.append(f"{pad}{_key(key)}: {{}}\n")
        elif _flat(value):
            lines.append(f"{pad}{_key(key)}: [{', '.join(_scalar(item) for item in value)}]\n")
        elif isinstance(value, list):
            lines.append(f"{pad}{_key(key)}:\n")
            lines += _sequence(value, depth + 1)
        else:
            lines.append(f"{pad}{_key(key)}: {_scalar(value)}\n")
    return lines


def _sequence(items: list, depth: int) -> list[str]:
    pad = "  " * depth
    lines: list[str] = []
    for item in items:
        if isinstance(item, dict) and item:
            body = _mapping(item, depth + 1)
            lines.append(f"{pad}- {body[0].lstrip()}")
            lines += body[1:]
        elif _flat(item):
            lines.append(f"{pad}- [{', '.join(_scalar(value) for value in item)}]\n")
        elif isinstance(item, list | dict):
            raise TypeError("nested lists are not written")
        else:
            lines.append(f"{pad}- {_scalar(item)}\n")
    return lines
