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

from services.worker.engine_spec import EngineSpec
from services.worker.sim.spec import SIM
from services.worker.vllm.spec import VLLM
from shared.config import ConfigError

ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (SIM, VLLM)}  # one line per engine


def engine_names() -> list[str]:
    return list(ENGINES)


def engine_spec(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r} (registered: {', '.join(ENGINES)})")
    return ENGINES[name]
