"""The stack definition: which services a Tandem cluster runs, their settings and what each
depends on, as data (`launch/stacks/local.toml` is the one `tandem up` runs).

It names no deployment: no processes, containers or command lines. A launcher turns it into
running services (`launch.plan` expands it into one instance per worker, `launch.stack`
starts those as local processes); a compose renderer can turn the same definition into
containers. A service's `settings` are its own options by name (`routing_policy`,
`kv_lease_ttl`, ...), each rendered the way the target passes options.

`load_definition(path)` reads a TOML file into typed structs and validates it; every
problem is a `DefinitionError` naming the file and the field. `with_overrides` applies
`tandem up`'s flags (counts, ports, engine) to a definition.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

import msgspec

from shared.schemas.membership import WorkerRole

Setting = str | int | float | bool
Settings = dict[str, Setting]

NATS, ORCHESTRATOR, METRICS, ROUTER = "nats", "orchestrator", "metrics", "router"
_NAME = re.compile(r"[a-z][a-z0-9_-]*")
_SETTING = re.compile(r"[a-z][a-z0-9_]*")
# Options the definition sets through its own fields: a setting may not say them again.
RESERVED_SETTINGS = frozenset({"nats_url", "namespace", "heartbeat_interval", "ttl", "host", "port",
                               "worker_id", "role", "engine", "model_dir"})


class DefinitionError(ValueError):
    """A stack definition that cannot be run, with where and why."""


class Nats(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str = ""  # empty: the launcher runs an embedded nats-server


class Membership(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    heartbeat_interval_s: float = 0.5
    ttl_s: float = 3.0  # a worker silent this long is removed


class Service(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A control service (orchestrator): no port of its own."""

    settings: Settings = {}
    depends_on: tuple[str, ...] = (NATS,)


class HttpService(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A service with an HTTP port (router, metrics collector); `health` answers 200 once
    it serves. Port 0: the launcher picks a free one."""

    host: str = "127.0.0.1"
    port: int
    health: str
    settings: Settings = {}
    depends_on: tuple[str, ...] = (NATS,)


class WorkerGroup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`count` workers of one role and engine; their ids are `<name>-1`, `<name>-2`, ...
    A worker is ready once it is registered in the membership bucket."""

    name: str
    role: WorkerRole
    count: int = 1
    engine: str = "sim"
    settings: Settings = {}
    depends_on: tuple[str, ...] = (NATS,)


class StackDefinition(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "local"
    namespace: str = "tandem"  # subject namespace: one per cluster
    model_dir: str = ""  # empty: the launcher provides one (tandem up: a generated tiny model)
    nats: Nats = Nats()
    membership: Membership = Membership()
    orchestrator: Service = Service()
    metrics: HttpService = HttpService(port=9100, health="/metrics")
    router: HttpService = HttpService(port=8000, health="/health", depends_on=(NATS, ORCHESTRATOR))
    routers: int = 1  # router processes on the router's port (more than one: SO_REUSEPORT, shared load)
    workers: tuple[WorkerGroup, ...] = ()

    def services(self) -> dict[str, Service | HttpService | WorkerGroup]:
        """Every service but NATS, by name (worker groups by group name)."""
        return {ORCHESTRATOR: self.orchestrator, METRICS: self.metrics, ROUTER: self.router,
                **{group.name: group for group in self.workers}}


def default_definition_path() -> Path:
    """The packaged local stack (`tandem up` without `--stack`)."""
    return Path(str(resources.files("launch").joinpath("stacks").joinpath("local.toml")))


def load_definition(path: str | Path) -> StackDefinition:
    """Read and validate a TOML stack definition."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise DefinitionError(f"{path}: cannot read the stack definition: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise DefinitionError(f"{path}: not valid TOML: {error}") from None
    return parse_definition(data, str(path))


def parse_definition(data: Mapping[str, object], source: str = "stack definition") -> StackDefinition:
    try:
        definition = msgspec.convert(data, StackDefinition)
    except msgspec.ValidationError as error:
        raise DefinitionError(f"{source}: {error}") from None
    problems = definition_problems(definition)
    if problems:
        raise DefinitionError(f"{source}: " + "; ".join(problems))
    return definition


def definition_problems(definition: StackDefinition, engines: Iterable[str] | None = None) -> list[str]:
    """What makes `definition` unrunnable, as readable lines (empty: none). `engines`: the
    registered engine names (default: the worker's engine registry)."""
    if engines is None:
        from services.worker.engines import engine_names

        engines = engine_names()
    known_engines = set(engines)
    problems: list[str] = []
    names = [group.name for group in definition.workers]
    for name in names:
        if not _NAME.fullmatch(name) or name in (NATS, ORCHESTRATOR, METRICS, ROUTER):
            problems.append(f"workers: {name!r} is not a usable group name (lower case, digits, '-', '_'; "
                            f"not a service's name)")
    problems += [f"workers: group name {name!r} is used twice" for name in sorted(set(names))
                 if names.count(name) > 1]
    for group in definition.workers:
        if group.count < 0:
            problems.append(f"workers.{group.name}.count: cannot be negative ({group.count})")
        if group.engine not in known_engines:
            problems.append(f"workers.{group.name}.engine: unknown engine {group.engine!r} "
                            f"(registered: {', '.join(sorted(known_engines))})")
    if not any(group.count > 0 and group.role is not WorkerRole.PREFILL for group in definition.workers):
        problems.append("workers: at least one decode (or both) worker is needed")
    for name, service in definition.services().items():
        problems += _service_problems(name, service, set(definition.services()) | {NATS})
    membership = definition.membership
    if membership.heartbeat_interval_s <= 0 or membership.ttl_s <= 2 * membership.heartbeat_interval_s:
        problems.append("membership: ttl_s must exceed two heartbeat intervals, both positive")
    if definition.routers < 1:
        problems.append(f"routers: at least one router is needed ({definition.routers})")
    problems += _cycle(definition)
    return problems


def _service_problems(name: str, service: Service | HttpService | WorkerGroup, known: set[str]) -> list[str]:
    where = f"workers.{name}" if isinstance(service, WorkerGroup) else name
    problems = [f"{where}.settings: {key!r} is not an option name (lower case and '_')"
                for key in service.settings if not _SETTING.fullmatch(key)]
    problems += [f"{where}.settings: {key!r} is set by the definition itself, not a setting"
                 for key in service.settings if key in RESERVED_SETTINGS]
    problems += [f"{where}.depends_on: no service named {dependency!r}"
                 for dependency in service.depends_on if dependency not in known]
    if isinstance(service, HttpService):
        if not 0 <= service.port <= 65535:
            problems.append(f"{where}.port: {service.port} is not a port (0 picks a free one)")
        if not service.health.startswith("/"):
            problems.append(f"{where}.health: {service.health!r} must be a path such as /health")
    return problems


def _cycle(definition: StackDefinition) -> list[str]:
    """A dependency cycle, if any, as one problem line."""
    graph = {name: service.depends_on for name, service in definition.services().items()}
    graph[NATS] = ()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> list[str]:
        if name in path:
            return [f"depends_on: cycle {' -> '.join((*path[path.index(name):], name))}"]
        if name in done or name not in graph:
            return []
        for dependency in graph[name]:
            if found := visit(dependency, (*path, name)):
                return found
        done.add(name)
        return []

    for name in graph:
        if found := visit(name, ()):
            return found
    return []


def with_overrides(definition: StackDefinition, *, engine: str | None = None,
                   counts: Mapping[WorkerRole, int] | None = None, router_host: str | None = None,
                   router_port: int | None = None, metrics_port: int | None = None, nats_url: str | None = None,
                   model_dir: str | None = None, routers: int | None = None) -> StackDefinition:
    """`definition` with `tandem up`'s flags applied (None: keep the definition's value).

    `counts` sets the number of workers per role: the first group of that role gets it and
    the role's other groups none; a role without a group gets one, named after the role
    ("worker" for role both), with the settings of the definition's first group."""
    replace = msgspec.structs.replace
    groups = list(definition.workers)
    for role, count in (counts or {}).items():
        same_role = [index for index, group in enumerate(groups) if group.role is role]
        if not same_role and count > 0:
            template = groups[0] if groups else WorkerGroup(name="", role=role)
            name = "worker" if role is WorkerRole.BOTH else role.value
            groups.append(replace(template, name=name, role=role, count=count))
        for position, index in enumerate(same_role):
            groups[index] = replace(groups[index], count=count if position == 0 else 0)
    if engine is not None:
        groups = [replace(group, engine=engine) for group in groups]
    router, metrics = definition.router, definition.metrics
    return replace(
        definition,
        workers=tuple(groups),
        router=replace(router, host=router.host if router_host is None else router_host,
                       port=router.port if router_port is None else router_port),
        metrics=replace(metrics, port=metrics.port if metrics_port is None else metrics_port),
        nats=definition.nats if nats_url is None else Nats(url=nats_url),
        model_dir=definition.model_dir if model_dir is None else model_dir,
        routers=definition.routers if routers is None else routers,
    )


def checked(definition: StackDefinition, source: str = "stack") -> StackDefinition:
    """`definition` if it is runnable (e.g. after overrides), else a `DefinitionError`."""
    problems = definition_problems(definition)
    if problems:
        raise DefinitionError(f"{source}: " + "; ".join(problems))
    return definition
