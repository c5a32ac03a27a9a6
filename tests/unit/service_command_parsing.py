"""Parsing a service's flags as `tandem <service>` does, for the renderer's tests
(`test_config_argv`, `test_launcher_argv`): by options made as the command's are, into its
config, and by the real command itself (nothing run)."""

from __future__ import annotations

from typing import Any

import click
import pytest
import typer
from typer.testing import CliRunner

from cli.config_options import config_options
from launch.service_commands import SERVICE_COMMANDS, ServiceCommand
from shared.config_fields import config_flags

COMMANDS = {command.name: command for command in SERVICE_COMMANDS}


def clear_flag_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsed configs are the flags' alone: no `TANDEM_*` default from this process."""
    for command in SERVICE_COMMANDS:
        for field_flag in config_flags(command.config_type, command.exclude):
            if field_flag.flag.env:
                monkeypatch.delenv(field_flag.flag.env, raising=False)


def parsed(command: ServiceCommand, argv: list[str]) -> Any:
    """`argv` (flags only) parsed by options made as `tandem <command>`'s are, into its config."""
    app = typer.Typer()
    seen: list[Any] = []

    @app.command()
    @config_options("config", command.config_type, exclude=command.exclude)
    def run(config: Any) -> None:
        seen.append(config)

    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, f"{command.name} {argv}: {result.output}"
    return seen[0]


def real_command(name: str) -> click.Command:
    from cli.main import app

    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def assert_real_command_parses(argv: list[str]) -> None:
    """`tandem <argv>` is parsed by the real command (nothing run): no unknown or bad flag."""
    name, *flags = argv
    real_command(name).make_context(name, list(flags))


def config_of(argv: list[str]) -> Any:
    """`tandem <argv>` parsed by the real command, and as its config."""
    assert_real_command_parses(argv)
    name, *flags = argv
    return parsed(COMMANDS[name], flags)
