"""Config -> command line: the inverse of the flag generator (`shared.config_fields`).

`config_argv(config, fields)` writes the flags from which `tandem <service>` parses back those
fields' values (`cli.config_options`): a switch as `--x` or `--no-x`, a repeated option once
per item, an enum by its value, a flag with its own `parse` through its `render`. Without
`fields`: every flag field whose value is not its flag's default. `options_argv` writes options
given by name (`kv_lease_ttl = 3`: a stack definition's settings), checked against the config's
flags. The launchers (`launch.argv`, `launch.compose_args`, the orchestrator's
`worker_command`) write every service's command line with these, so a renamed flag or field
fails their unit tests instead of a launched process.

Secrets never reach a command line (anyone on the host reads it in the process list): the
configs hold the paths of the files that keep them (`shared.nats_secrets`, `shared.api_keys_file`),
and every value written first passes its flag's own check, the one the service runs on it: a
NATS URL carrying a user and password is refused here, as `tandem <service>` would refuse it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, get_origin

import msgspec

from shared.config import ConfigError
from shared.config_fields import FieldFlag, config_flags


def field_at(config: Any, path: tuple[str, ...]) -> Any:
    """The value of the field at `path` (`("routing", "policy")`) of `config`."""
    for name in path:
        config = getattr(config, name)
    return config


def option_value(field_flag: FieldFlag, value: Any) -> Any:
    """`value` of the field as its option takes it: the inverse of `FieldFlag.field_value`. A
    flag whose `parse` makes the field's value checks that this value parses back to it."""
    declared = field_flag.flag
    option = declared.render(value) if declared.render is not None else value
    if option is not None and declared.parse is not None and declared.parse(option) != value:  # parse raises ConfigError where it refuses
        raise ConfigError(f"{declared.name}: {value!r} does not survive the command line (its flag needs a render)")
    return option


def field_default(field_flag: FieldFlag) -> Any:
    """The field's value when its option is not given (the option's default, parsed)."""
    return field_flag.field_value(field_flag.default)


def _text(value: Any) -> str:
    return str(value.value if isinstance(value, Enum) else value)


def field_argv(field_flag: FieldFlag, value: Any) -> list[str]:
    """The flags that set the field of `field_flag` to `value` (none: it is the default and
    cannot be written otherwise, an empty repeated option or an unset optional one)."""
    name = field_flag.flag.name
    option = option_value(field_flag, value)
    if field_flag.option_type is bool:
        return [name if option else f"--no-{name.removeprefix('--')}"]
    if option is None or (get_origin(field_flag.field_type) is tuple and not option):
        if value != field_default(field_flag):
            raise ConfigError(f"{name}: {value!r} cannot be written on a command line (only the default can)")
        return []
    if get_origin(field_flag.field_type) is tuple and field_flag.flag.render is None:
        return [part for item in option for part in (name, _text(item))]
    return [name, _text(option)]


def config_argv(config: Any, fields: Iterable[str] | None = None, *, exclude: tuple[str, ...] = ()) -> list[str]:
    """The flags of `config`'s `fields` (dotted paths, `"bus.nats_url"`), in declaration order,
    whatever their values; `fields` None: those whose values are not their flags' defaults.
    `exclude`: the fields the command takes no option for (as `config_flags`'s)."""
    flags = config_flags(type(config), exclude)
    if fields is None:
        chosen = [field_flag for field_flag in flags if field_at(config, field_flag.path) != field_default(field_flag)]
    else:
        wanted = set(fields)
        chosen = [field_flag for field_flag in flags if ".".join(field_flag.path) in wanted]
        unknown = wanted - {".".join(field_flag.path) for field_flag in chosen}
        if unknown:
            raise ConfigError(f"{type(config).__name__} has no flag field {', '.join(sorted(unknown))}")
    return [part for field_flag in chosen for part in field_argv(field_flag, field_at(config, field_flag.path))]


def _setting_value(field_flag: FieldFlag, setting: Any) -> Any:
    """A setting (the option's value by name) as the field's value, converted as the option is."""
    if get_origin(field_flag.option_type) is tuple and not isinstance(setting, (list, tuple)):
        setting = (setting,)  # one item of a repeated option
    try:
        return field_flag.field_value(msgspec.convert(setting, field_flag.option_type))
    except msgspec.ValidationError as error:
        raise ConfigError(f"{field_flag.flag.name}: {setting!r} is not a value of it ({error})") from None


def options_argv(config_type: type, options: Mapping[str, Any], *, exclude: tuple[str, ...] = ()) -> list[str]:
    """The flags of `options`, by the options' Python names (`kv_lease_ttl`, `routing_policy`:
    a stack definition's settings), in their order; a name that is not one of `config_type`'s
    flags (`exclude`d ones neither) is a ConfigError."""
    by_name = {field_flag.parameter: field_flag for field_flag in config_flags(config_type, exclude)}
    unknown = [name for name in options if name not in by_name]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not an option of {config_type.__name__}'s command")
    return [part for name, setting in options.items()
            for part in field_argv(by_name[name], _setting_value(by_name[name], setting))]
