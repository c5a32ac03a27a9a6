"""`tandem worker`'s config (`services.worker.config.WorkerCommandConfig`): the worker's own
config and one part per registered engine, named after it and typed by its `EngineSpec`;
an engine's options reach its builder through the part of the engine the worker runs."""

from __future__ import annotations

import msgspec
import pytest

from services.worker.config import WorkerCommandConfig
from services.worker.engines import ENGINES
from services.worker.sim.config import SimEngineConfig
from services.worker.vllm.config import VllmEngineConfig
from services.worker.vllm.options import VllmEngineOptions
from services.worker.vllm.spec import KV_CACHE_GIB
from shared.config import ConfigError, WorkerConfig
from tests.unit.service_command_parsing import COMMANDS, clear_flag_environment, parsed


def test_every_engine_has_its_part_named_after_it() -> None:
    fields = {field.name: field.type for field in msgspec.structs.fields(WorkerCommandConfig)}
    assert fields == {"worker": WorkerConfig, **{name: spec.config_type for name, spec in ENGINES.items()}}


def test_the_engines_options_parse_into_their_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_flag_environment(monkeypatch)
    command = parsed(COMMANDS["worker"], ["--worker-id", "w", "--engine", "vllm", "--sim-speedup", "4",
                                          "--vllm-block-size", "64", "--no-vllm-eager", "--vllm-dtype", "float32"])
    assert command.worker.engine == "vllm" and command.sim == SimEngineConfig(speedup=4.0)
    assert command.engine_config() == VllmEngineConfig(block_size=64, enforce_eager=False, dtype="float32")
    options = VllmEngineOptions.from_worker_config(WorkerConfig(worker_id="w", engine="vllm"), command.vllm)
    assert options.dtype == "float32"  # what vLLM's engine arguments take (`engine_config`)


def test_the_running_engines_options_are_checked() -> None:
    WorkerCommandConfig(worker=WorkerConfig(worker_id="w"), sim=SimEngineConfig(speedup=2.0)).validate()
    with pytest.raises(ConfigError, match="sim speed-up"):
        WorkerCommandConfig(worker=WorkerConfig(worker_id="w"), sim=SimEngineConfig(speedup=0)).validate()
    with pytest.raises(ConfigError, match="vLLM block size"):
        WorkerCommandConfig(worker=WorkerConfig(worker_id="w", engine="vllm"),
                            vllm=VllmEngineConfig(block_size=-1)).validate()
    with pytest.raises(ConfigError, match="vLLM dtype must be one of auto, bfloat16, float16, float32, not 'fp8'"):
        WorkerCommandConfig(worker=WorkerConfig(worker_id="w", engine="vllm"),
                            vllm=VllmEngineConfig(dtype="fp8")).validate()


def test_an_engines_launch_flags_parse_into_its_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's per-worker launch flags (one core each, a small KV cache) are written from its
    options' config, so a renamed field or flag fails here, not in a launched worker."""
    clear_flag_environment(monkeypatch)
    flags = ENGINES["vllm"].launch_args(3, [0, 1])
    command = parsed(COMMANDS["worker"], ["--worker-id", "w", "--engine", "vllm", *flags])
    assert command.vllm == VllmEngineConfig(cpu_threads_bind="1", kv_cache_gib=KV_CACHE_GIB)
    assert ENGINES["vllm"].launch_args(0, []) == ()
