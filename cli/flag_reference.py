"""docs/configuration.md's flag reference, generated from the service configs' flag fields
(`shared.config_fields`), the same fields the service commands' options are made from.
`python -m cli.flag_reference` prints it; a unit test checks the doc holds it as printed.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from cli.services import SERVICE_CONFIGS
from shared.config_fields import FieldFlag, config_flags


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == "" or value == ():
        return "–"
    return f"`{value.value if isinstance(value, Enum) else value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(field_flag: FieldFlag) -> tuple[str, str, str, str]:
    declared = field_flag.flag
    meaning = " ".join(part for part in (declared.help, declared.doc) if part)
    return f"`{field_flag.declaration}`", f"`{declared.env}`" if declared.env else "–", _default(field_flag.default), _cell(meaning)


def markdown_table() -> str:
    """One row per flag, naming the services that take it (`all`: every one) where they agree."""
    services: dict[tuple[str, str, str, str], list[str]] = {}
    for service, config_type, exclude in SERVICE_CONFIGS:
        for field_flag in config_flags(config_type, exclude):
            services.setdefault(_row(field_flag), []).append(service)
    lines = ["| flag | service | environment | default | meaning |", "|---|---|---|---|---|"]
    for (name, env, default, meaning), takers in services.items():
        taken_by = "all" if len(takers) == len(SERVICE_CONFIGS) else ", ".join(takers)
        lines.append(f"| {name} | {taken_by} | {env} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
