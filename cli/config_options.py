"""Service command options made from config fields (`shared.config_fields`).

    @app.command()
    @config_options("config", RouterConfig)
    def router(config: RouterConfig, log_level: LogLevel = "info") -> None: ...

replaces the command's `config` parameter by one typer option per flag of RouterConfig (its
nested configs' included), in field order; when the command runs, the config is built from
the parsed options and passed in as `config`. Typer reads the options from the function's
`__signature__`. A flag's `parse` failing (ConfigError) is a bad value of that flag.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional, Union, cast, get_args, get_origin

import msgspec
import typer

from shared.config import ConfigError
from shared.config_argv import field_at, option_value
from shared.config_fields import FieldFlag, build_config, config_flags


def option_type(annotation: Any) -> Any:
    """The type typer parses a field's option as: a Literal's values as plain strings (the
    config's validate() names the allowed ones), a tuple as a repeated option."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return type(args[0])
    if origin is tuple:
        return list[args[0]]
    if origin is Union or (origin is not None and type(None) in args):
        others = [arg for arg in args if arg is not type(None)]
        if len(others) == 1:
            return Optional[option_type(others[0])]
    return annotation


def option_parameter(field_flag: FieldFlag, default: Any = msgspec.NODEFAULT) -> inspect.Parameter:
    """The option of `field_flag`; `default`: its default where not the flag's."""
    declared = field_flag.flag
    option = typer.Option(field_flag.declaration, help=declared.help or None, envvar=declared.env or None)
    default = field_flag.default if default is msgspec.NODEFAULT else default
    default = list(default) if isinstance(default, tuple) else default
    return inspect.Parameter(field_flag.parameter, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[option_type(field_flag.option_type), option])


def config_options(parameter: str, config_type: type, *, exclude: tuple[str, ...] = (),
                   defaults: Any = None) -> Callable:
    """The decorator described in the module docstring; `exclude`: config fields that get no
    option (`"membership"`, `"bus.replicas"`): they keep their defaults. `defaults`: a
    `config_type` whose values are the defaults instead of the fields' own (the options' and
    those of the fields that get none)."""
    flags = config_flags(config_type, exclude)
    option_defaults = {field_flag.path: msgspec.NODEFAULT if defaults is None else
                       option_value(field_flag, field_at(defaults, field_flag.path)) for field_flag in flags}

    def decorate(command: Callable) -> Callable:
        own = inspect.signature(command, eval_str=True).parameters
        parameters: list[inspect.Parameter] = []
        for name, declared in own.items():
            if name == parameter:
                parameters += [option_parameter(field_flag, option_defaults[field_flag.path]) for field_flag in flags]
            else:
                parameters.append(declared.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        names = [declared.name for declared in parameters]
        assert len(names) == len(set(names)), f"{command.__name__}: two options of one name in {names}"

        def run(**options: Any) -> Any:
            values = {}
            for field_flag in flags:
                try:
                    values[field_flag.path] = field_flag.field_value(options.pop(field_flag.parameter))
                except ConfigError as error:
                    raise typer.BadParameter(str(error), param_hint=field_flag.flag.name) from None
            return command(**options, **{parameter: build_config(config_type, values, defaults)})

        run.__name__, run.__qualname__, run.__doc__ = command.__name__, command.__qualname__, command.__doc__
        run.__module__ = command.__module__
        # typer reads the options from the signature; a function's type does not declare the attribute.
        cast(Any, run).__signature__ = inspect.Signature(parameters)
        return run

    return decorate


def field_option(config_type: type, field: str) -> Any:
    """The option of one flag field of `config_type` as an annotation, for a command that takes
    it by itself (`tandem ctl`'s `--nats-url`)."""
    [field_flag] = [field_flag for field_flag in config_flags(config_type) if field_flag.path == (field,)]
    return option_parameter(field_flag).annotation
