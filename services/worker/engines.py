"""The engine registry: every engine a worker can run, registered once by name.

An engine package describes itself in an `EngineSpec` (its `spec` module) and is listed
in `ENGINES` with one line. Everything else asks the registry instead of comparing engine
names: the worker's wiring builds the engine and its KV data plane through the spec, the
launcher asks for the engine's start timeout and per-worker launch flags, the CLI lists the
names, and the router decides how KV moves from the capabilities a worker advertises in
its registration (`EngineCapabilities`), never from the name.

Specs import their engine lazily (in `build_engine` / `build_data_plane`): listing the
registry never imports vLLM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.config import ConfigError
from shared.schemas.membership import EngineCapabilities

if TYPE_CHECKING:
    from connector.dataplane import DataPlane
    from services.worker.engine import Engine
    from shared.bus import Bus
    from shared.config import WorkerConfig


def no_launch_args(index: int, cores: Sequence[int]) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    summary: str  # one line for help texts
    capabilities: EngineCapabilities
    build_engine: Callable[[WorkerConfig], Engine]
    # The engine's KV data plane (`connector.dataplane.DataPlane`, what `WorkerService` calls).
    build_data_plane: Callable[[WorkerConfig, Engine, Bus], DataPlane]
    requires_module: str = ""  # a module this Python must have to run the engine ("" none)
    install_hint: str = ""  # how to get `requires_module`
    start_timeout_s: float = 60.0  # how long a launcher waits for such a worker to register
    # Per-worker flags a launcher adds for the worker at `index` given the usable cores
    # (e.g. pinning CPU engines one per core).
    launch_args: Callable[[int, Sequence[int]], tuple[str, ...]] = field(default=no_launch_args)

    def problem(self) -> str | None:
        """Why this Python cannot run the engine, or None."""
        if self.requires_module and importlib.util.find_spec(self.requires_module) is None:
            return f"the {self.name} engine needs {self.requires_module!r}, not installed here: {self.install_hint}"
        return None


def _registered() -> dict[str, EngineSpec]:
    from services.worker.sim.spec import SIM
    from services.worker.vllm.spec import VLLM

    return {spec.name: spec for spec in (SIM, VLLM)}


def engine_names() -> list[str]:
    return list(_registered())


def engine_spec(name: str) -> EngineSpec:
    specs = _registered()
    if name not in specs:
        raise ConfigError(f"unknown engine {name!r} (registered: {', '.join(specs)})")
    return specs[name]
