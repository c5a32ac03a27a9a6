"""Command-line flags declared on config fields, so that a knob is declared once.

A config field that a service command sets says so where it is declared:

    port: Annotated[int, flag("HTTP port; 0 picks a free one.", env="TANDEM_PORT")] = 8000

`flag` records the flag's name (by default the field's: `--port`), its help text and its
environment variable; `config_flags(RouterConfig)` lists the flags of a config and of the
configs nested in it. The CLI makes a service command's options from that list and builds the
config from the parsed values (`cli.config_options`), docs/configuration.md's flag reference
is generated from it (`cli.flag_reference`), and launchers write a config back as a command
line from it (`shared.config_argv`). Only the CLI reads the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, get_args, get_origin

import msgspec

_FLAG = "flag"


@dataclass(frozen=True)
class Flag:
    name: str = ""  # "--kv-lease-ttl"; empty: from the field's name
    help: str = ""
    env: str = ""  # the environment variable the CLI reads as the default; empty: none
    doc: str = ""  # what the flag reference says beyond the help text
    # Where the option is not the field (`--worker-args "a b"` is a tuple of arguments): its
    # type and default, and `parse`, the option's value -> the field's; `parse` may raise
    # ConfigError, reported as a bad value of this flag
    option_type: Any = None
    default: Any = msgspec.NODEFAULT  # the option's default where it is not the field's
    parse: Callable[[Any], Any] | None = None
    # `parse`'s inverse where the option's value is not the field's (`shlex.join` for
    # `--worker-args`): how `shared.config_argv` writes the field back as the option
    render: Callable[[Any], Any] | None = None


def flag(help: str = "", *, name: str = "", env: str = "", doc: str = "", option_type: Any = None,
         default: Any = msgspec.NODEFAULT, parse: Callable[[Any], Any] | None = None,
         render: Callable[[Any], Any] | None = None) -> msgspec.Meta:
    """The metadata that makes a config field a flag (see the module docstring)."""
    return msgspec.Meta(extra={_FLAG: Flag(name=name, help=help, env=env, doc=doc, option_type=option_type,
                                           default=default, parse=parse, render=render)})


@dataclass(frozen=True)
class FieldFlag:
    """One flag of a config: its field's `path` from the outer config (`("routing", "policy")`),
    the field's type (metadata removed) and the option's default."""

    path: tuple[str, ...]
    flag: Flag
    field_type: Any
    default: Any

    @property
    def parameter(self) -> str:
        """The option's Python name (`--kv-lease-ttl`: `kv_lease_ttl`), a stack definition's setting name."""
        return self.flag.name.removeprefix("--").replace("-", "_")

    @property
    def declaration(self) -> str:
        """The option's names as typer takes them: a switch is `--prefix-pull/--no-prefix-pull`."""
        if self.option_type is bool:
            return f"{self.flag.name}/--no-{self.flag.name.removeprefix('--')}"
        return self.flag.name

    @property
    def option_type(self) -> Any:
        return self.flag.option_type if self.flag.option_type is not None else self.field_type

    def field_value(self, option_value: Any) -> Any:
        if self.flag.parse is not None:
            return self.flag.parse(option_value)
        if get_origin(self.field_type) is tuple and option_value is not None:
            return tuple(option_value)  # a repeated option comes as a list
        return option_value


def _flag_of(annotation: Any) -> Flag | None:
    if get_origin(annotation) is not Annotated:
        return None
    for meta in get_args(annotation)[1:]:
        if isinstance(meta, msgspec.Meta) and meta.extra and _FLAG in meta.extra:
            return meta.extra[_FLAG]
    return None


def _bare(annotation: Any) -> Any:
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def is_config(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def config_flags(config_type: type, exclude: tuple[str, ...] = (), _prefix: tuple[str, ...] = ()) -> list[FieldFlag]:
    """The flags of `config_type`'s fields in declaration order, a nested config's flags in its
    field's place; `exclude` names fields left out (`"membership"`, `"bus.replicas"`)."""
    flags: list[FieldFlag] = []
    for field in msgspec.structs.fields(config_type):
        path = (*_prefix, field.name)
        if ".".join(path) in exclude:
            continue
        declared, field_type = _flag_of(field.type), _bare(field.type)
        if declared is None:
            if is_config(field_type):
                flags += config_flags(field_type, exclude, path)
            continue
        name = declared.name or "--" + field.name.replace("_", "-")
        default = field.default if declared.default is msgspec.NODEFAULT else declared.default
        assert default is not msgspec.NODEFAULT, f"flag {name} needs a default"
        flags.append(FieldFlag(path, replace(declared, name=name), field_type, default))
    return flags


def flag_name(config_type: type, field: str) -> str:
    """The flag of `config_type`'s `field` (a dotted path, `"kv_transfer.lease_ttl_s"`:
    `--kv-lease-ttl`), for messages: a message names a flag through its field, so a renamed
    flag cannot leave it wrong."""
    [field_flag] = [field_flag for field_flag in config_flags(config_type) if ".".join(field_flag.path) == field]
    return field_flag.flag.name


def build_config(config_type: type, values: dict[tuple[str, ...], Any], base: Any = None) -> Any:
    """A `config_type` with the field values given by path (`("routing", "policy")`); the
    fields not given keep their defaults (with `base`, a `config_type`: its values), as do
    nested configs none of whose fields is given."""
    own: dict[str, Any] = {}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in values.items():
        if len(path) == 1:
            own[path[0]] = value
        else:
            nested.setdefault(path[0], {})[path[1:]] = value
    field_types = {field.name: _bare(field.type) for field in msgspec.structs.fields(config_type)}
    for name, inner in nested.items():
        own[name] = build_config(field_types[name], inner, None if base is None else getattr(base, name))
    return config_type(**own) if base is None else msgspec.structs.replace(base, **own)
