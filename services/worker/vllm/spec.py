"""The vLLM engine's registration (see services/worker/engines.py). Importing this module
imports no vLLM: the builders do, when a worker starts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.worker.engine_spec import EngineDeployment, EngineSpec
from services.worker.vllm.config import VllmEngineConfig
from shared.config import ConfigError
from shared.config_argv import config_argv
from shared.model_config import read_text_config
from shared.schemas.membership import EngineCapabilities

if TYPE_CHECKING:
    from services.worker.engine import Engine
    from shared.bus import Bus
    from shared.config import WorkerConfig

START_TIMEOUT_S = 300.0  # engine start-up, model load and KV cache allocation on a busy CPU
KV_CACHE_GIB = 1.0  # per engine launched by the stack; with the model and runtime ~2.6 GB each


def build_engine(config: WorkerConfig, vllm_config: VllmEngineConfig) -> Engine:
    try:
        from services.worker.vllm.engine import VllmEngine
        from services.worker.vllm.options import VllmEngineOptions
    except ImportError as error:
        raise ConfigError(f"vLLM is not installed (make install-vllm; "
                          f"services/worker/vllm/requirements-cpu.txt): {error}") from error
    return VllmEngine(VllmEngineOptions.from_worker_config(config, vllm_config))


def build_data_plane(config: WorkerConfig, engine: Engine, bus: Bus):
    # The data plane lives in vLLM's engine process (Tandem's KV connector); the worker
    # speaks the lease protocol for it. Blocks move between vLLM's processes: NIXL only.
    if config.kv_transfer.transport != "nixl":
        raise ConfigError(f"the vLLM engine moves KV over NIXL only, not the "
                          f"{config.kv_transfer.transport!r} transport")
    from connector.vllm.worker_kv import VllmWorkerKv

    return VllmWorkerKv(config, bus, engine, block_size=engine.info.block_size,
                        compat_hash=engine.info.compat_hash)


def launch_args(index: int, cores: Sequence[int]) -> tuple[str, ...]:
    """CPU engines one per core, round-robin: two engines on one core set would each size
    their thread pool for all of it."""
    if not cores:
        return ()
    engine = VllmEngineConfig(cpu_threads_bind=str(sorted(cores)[index % len(cores)]), kv_cache_gib=KV_CACHE_GIB)
    return tuple(config_argv(engine, ("cpu_threads_bind", "kv_cache_gib")))


def kv_cache_settings(blocks: int, block_size: int, model_dir: str) -> dict[str, int | float | str]:
    """vLLM sizes its KV cache in bytes: `blocks` blocks of the model's 16-bit KV (vLLM on CPU
    runs a float32 model in bfloat16), with that block size; a vision-language model's KV is
    its text model's."""
    config = read_text_config(model_dir)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    block_nbytes = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * block_size * 2
    return {"vllm_kv_cache_gib": blocks * block_nbytes / (1 << 30), "vllm_block_size": block_size}


VLLM = EngineSpec(
    name="vllm",
    summary="vLLM (AsyncLLM in the worker) with Tandem's KV connector",
    capabilities=EngineCapabilities(kv_pull=True, kv_push=True),  # pull, and push (connector.vllm.push)
    config_type=VllmEngineConfig,
    build_engine=build_engine,
    build_data_plane=build_data_plane,
    requires_module="vllm",
    install_hint="`make run` installs it in .venv-vllm (or `make install-vllm`, then use .venv-vllm/bin/tandem)",
    start_timeout_s=START_TIMEOUT_S,
    launch_args=launch_args,
    kv_cache_settings=kv_cache_settings,
    # vLLM's processes share tensors through /dev/shm; the Tandem image has the sim engine only.
    deployment=EngineDeployment(in_tandem_image=False, shm_size="1gb", cpu_request="4", memory_request="16Gi",
                                cpu_limit="16", memory_limit="32Gi", start_grace_s=900, stop_grace_s=180),
    has_plain_server=True,  # `vllm serve`
)
