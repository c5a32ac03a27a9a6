"""Config fields as flags (`shared.config_fields`, `cli.config_options`): a field's flag
metadata makes the command option, the option builds the config (nested configs, tuples,
`--no-` switches, a flag's own parse), excluded fields keep their defaults; the service
commands take exactly their configs' flags, and docs/configuration.md shows the table the
fields make."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import typer
from typer.testing import CliRunner

from cli.config_options import config_options
from cli.flag_reference import markdown_table
from cli.services import SERVICE_CONFIGS
from shared.config import ConfigError
from shared.config_fields import config_flags, flag

CONFIGURATION_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _even(value: int) -> int:
    if value % 2:
        raise ConfigError("must be even")
    return value


class Inner(msgspec.Struct, kw_only=True, frozen=True):
    weight: Annotated[float, flag("A weight.", name="--inner-weight", env="TEST_INNER_WEIGHT")] = 0.5
    hidden: int = 7  # no flag: no option


class Outer(msgspec.Struct, kw_only=True, frozen=True):
    name: Annotated[str, flag("A name.")] = "x"
    mode: Annotated[Literal["a", "b"], flag("a or b.")] = "a"
    switch: Annotated[bool, flag("On or off.")] = True
    paths: Annotated[tuple[str, ...], flag("Repeat.", name="--path")] = ()
    even: Annotated[int, flag("An even number.", parse=_even)] = 2
    limit: Annotated[int | None, flag("None: no limit.")] = None
    inner: Inner = Inner()
    left_out: Inner = Inner()


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, list[Outer]]:
    app = typer.Typer()
    seen: list[Outer] = []

    @app.command()
    @config_options("config", Outer, exclude=("left_out",))
    def command(config: Outer, extra: int = 0) -> None:
        seen.append(config)

    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.output, seen


def test_the_options_are_the_flag_fields_and_build_the_config() -> None:
    assert [field_flag.flag.name for field_flag in config_flags(Outer, ("left_out",))] == [
        "--name", "--mode", "--switch", "--path", "--even", "--limit", "--inner-weight"]
    code, output, [config] = _run("--name", "y", "--mode", "b", "--no-switch", "--path", "p", "--path", "q",
                                  "--even", "4", "--limit", "3", "--extra", "1",
                                  env={"TEST_INNER_WEIGHT": "2.5"})
    assert code == 0, output
    assert config == Outer(name="y", mode="b", switch=False, paths=("p", "q"), even=4, limit=3, inner=Inner(weight=2.5))
    assert _run()[2] == [Outer()]


def test_a_failed_parse_is_a_bad_value_of_its_flag() -> None:
    code, output, seen = _run("--even", "3")
    assert code == 2 and not seen
    assert "--even" in output and "must be even" in output


def test_excluded_and_unflagged_fields_get_no_option() -> None:
    code, output, _ = _run("--help")
    assert code == 0 and output.count("--inner-weight") == 1 and "--hidden" not in output
    assert _run("--inner-weight", "1")[2][0].left_out == Inner()


def test_each_service_command_takes_its_configs_flags_and_the_log_level() -> None:
    from cli.main import app

    commands = typer.main.get_command(app).commands
    for service, config_type, exclude in SERVICE_CONFIGS:
        options = [param.opts[0] for param in commands[service].params]
        assert options == [field_flag.flag.name for field_flag in config_flags(config_type, exclude)] + ["--log-level"]


def test_the_configuration_doc_shows_the_flag_table_as_the_fields_make_it() -> None:
    assert markdown_table() in CONFIGURATION_DOC.read_text(), (
        "docs/configuration.md's flag reference is not the fields': regenerate it: python -m cli.flag_reference")
