"""What an engine registers: `EngineSpec`, its name, its own options' config, capabilities,
builders, launch needs and deployment facts (`EngineDeployment`: image, shared memory, resources, whether many
workers of it share a process). Each engine package defines one in its `spec` module;
`services.worker.engines` lists them."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from shared.schemas.membership import EngineCapabilities

if TYPE_CHECKING:
    from connector.dataplane import DataPlane
    from services.worker.engine import Engine
    from shared.bus import Bus
    from shared.config import WorkerConfig


def no_launch_args(index: int, cores: Sequence[int]) -> tuple[str, ...]:
    return ()


def kv_blocks_settings(blocks: int, block_size: int, model_dir: str) -> dict[str, int | float | str]:
    """Worker settings for a KV cache of `blocks` blocks of `block_size` tokens: `kv_blocks`."""
    return {"kv_blocks": blocks, "block_size": block_size}


@dataclass(frozen=True, slots=True)
class EngineDeployment:
    """What a deployment (compose, Kubernetes, a worker fleet) gives this engine's workers."""

    in_tandem_image: bool = True  # False: the worker's image is named separately (--worker-image)
    shm_size: str = ""  # the container's /dev/shm ("": Docker's default)
    cpu_request: str = "500m"  # Kubernetes requests and limits of one worker's container
    memory_request: str = "512Mi"
    cpu_limit: str = "2"
    memory_limit: str = "2Gi"
    start_grace_s: int = 300  # Kubernetes: how long a worker may take to join before it is restarted
    stop_grace_s: int = 60  # Kubernetes: how long a stopping worker may take
    in_fleet: bool = False  # many workers of it may share one process (`tandem worker-fleet`)


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    summary: str  # one line for help texts
    capabilities: EngineCapabilities
    # The engine's own options (a config struct with flags, in the engine's package): the
    # part of `tandem worker`'s config named after the engine (`WorkerCommandConfig`)
    config_type: type[msgspec.Struct]
    build_engine: Callable[[WorkerConfig, Any], Engine]  # the worker's config, the engine's own
    # The engine's KV data plane (`connector.dataplane.DataPlane`, what `WorkerService` calls).
    build_data_plane: Callable[[WorkerConfig, Engine, Bus], DataPlane]
    requires_module: str = ""  # a module this Python must have to run the engine ("" none)
    install_hint: str = ""  # how to get `requires_module`
    start_timeout_s: float = 60.0  # how long a launcher waits for such a worker to register
    # Per-worker flags a launcher adds for the worker at `index` given the usable cores
    # (e.g. pinning CPU engines one per core).
    launch_args: Callable[[int, Sequence[int]], tuple[str, ...]] = field(default=no_launch_args)
    # Worker settings that size the engine's own KV cache to (blocks, block size) of the model
    # in a directory (a benchmark sizes every engine's cache the same way).
    kv_cache_settings: Callable[[int, int, str], dict[str, int | float | str]] = field(default=kv_blocks_settings)
    deployment: EngineDeployment = EngineDeployment()
    # The engine's own OpenAI server runs as a benchmark's peer (`tandem bench serve`'s Nxvllm).
    has_plain_server: bool = False

    def problem(self) -> str | None:
        """Why this Python cannot run the engine, or None."""
        if self.requires_module and importlib.util.find_spec(self.requires_module) is None:
            return f"the {self.name} engine needs {self.requires_module!r}, not installed here: {self.install_hint}"
        return None
