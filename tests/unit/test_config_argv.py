"""Config -> argv (`shared.config_argv`), the inverse of the flag generator: every service's
config, at its defaults and with every flag field set to another value of its type, is written
as flags and parsed back by the service command's own options (`cli.config_options`) into an
equal config; what each launcher writes parses through the real `tandem <service>` commands;
a value that would carry a secret onto a command line is refused."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, get_args, get_origin

import pytest

from launch.service_commands import SERVICE_COMMANDS, WORKER_COMMAND, ServiceCommand
from shared.config import BusConfig, ConfigError, WorkerConfig
from shared.config_argv import config_argv, field_default, options_argv
from shared.config_fields import FieldFlag, build_config, config_flags
from tests.unit.service_command_parsing import COMMANDS, assert_real_command_parses, clear_flag_environment, parsed


@pytest.fixture(autouse=True)
def _no_flag_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_flag_environment(monkeypatch)


def _other(field_type: Any, default: Any, field_flag: FieldFlag) -> Any:
    """A value of `field_type` that is not `default`."""
    origin, args = get_origin(field_type), get_args(field_type)
    if origin is Literal:
        return next(arg for arg in args if arg != default)
    if origin is tuple:
        return ("--model-version", "v 2") if field_flag.flag.render else ("one", "two=2")
    if type(None) in args:
        return _other(next(arg for arg in args if arg is not type(None)), 0, field_flag)
    if isinstance(field_type, type) and issubclass(field_type, Enum):
        return next(member for member in field_type if member != default)
    if field_type is bool:
        return not default
    if field_type is int:
        return default + 3
    if field_type is float:
        return default + 1.25
    assert field_type is str, f"{field_flag.flag.name}: no other value for {field_type}"
    return "nats://other-host:4333" if field_flag.parameter == "nats_url" else f"{default}other-{field_flag.parameter}"


def every_field_changed(command: ServiceCommand) -> Any:
    flags = config_flags(command.config_type, command.exclude)
    return build_config(command.config_type, {field_flag.path: _other(field_flag.field_type, field_flag.default,
                                                                      field_flag) for field_flag in flags})


@pytest.mark.parametrize("name", COMMANDS)
def test_every_service_config_parses_back_equal_from_its_flags(name: str) -> None:
    command = COMMANDS[name]
    flags = config_flags(command.config_type, command.exclude)
    defaults = build_config(command.config_type, {field_flag.path: field_default(field_flag) for field_flag in flags})
    assert config_argv(defaults, exclude=command.exclude) == []
    assert parsed(command, []) == defaults
    changed = every_field_changed(command)
    argv = config_argv(changed, exclude=command.exclude)
    assert len(argv) >= len(flags)  # every field written
    assert parsed(command, argv) == changed
    every_field = [".".join(field_flag.path) for field_flag in flags]
    assert parsed(command, config_argv(defaults, every_field, exclude=command.exclude)) == defaults


def test_settings_are_written_by_option_name_and_typed() -> None:
    assert options_argv(WorkerConfig, {"kv_lease_ttl": 3, "kv_transfer": False, "adapter": "a"}) == [
        "--kv-lease-ttl", "3.0", "--no-kv-transfer", "--adapter", "a"]
    with pytest.raises(ConfigError, match="model_path: not an option"):
        options_argv(WorkerConfig, {"model_path": "/m"})  # a renamed option fails where it is written
    with pytest.raises(ConfigError, match="--kv-blocks"):
        options_argv(WorkerConfig, {"kv_blocks": "many"})
    with pytest.raises(ConfigError, match="ttl: not an option"):
        COMMANDS["metrics"].setting_flags({"ttl": 3.0})  # the collector takes no membership flags


def test_a_field_that_is_no_flag_is_refused_by_name() -> None:
    worker = WorkerConfig(worker_id="w")
    with pytest.raises(ConfigError, match="no flag field model_path"):
        config_argv(worker, ("worker_id", "model_path"))
    with pytest.raises(ConfigError, match="no flag field drain_timeout_s"):
        config_argv(worker, ("drain_timeout_s",))  # no option: a launcher cannot set it on the command line


def test_no_secret_reaches_a_command_line() -> None:
    """NATS credentials live in a file (`--nats-creds-file`): a URL carrying them is refused by
    the same check the service runs, not written into the process list."""
    with pytest.raises(ConfigError, match="no user or password"):
        config_argv(BusConfig(nats_url="nats://admin:s3cret@nats:4222"), ("nats_url",))
    with pytest.raises(ConfigError, match="no user or password"):
        WORKER_COMMAND.setting_flags({"nats_url": "nats://admin:s3cret@nats:4222"})
    argv = config_argv(BusConfig(creds_file="/run/secrets/worker.creds"))
    assert argv == ["--nats-creds-file", "/run/secrets/worker.creds"]  # the file's path, never its contents


def test_the_real_commands_parse_every_field_written() -> None:
    for command in SERVICE_COMMANDS:
        assert_real_command_parses([command.name, *config_argv(every_field_changed(command), exclude=command.exclude)])
