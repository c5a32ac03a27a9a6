"""The typed settings of one vLLM engine, built once (from `WorkerConfig` in the worker's
wiring) and passed to `VllmEngine`. Nothing below reads the environment."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from connector.vllm.settings import EncoderCacheSettings, KvConnectorOptions
from services.worker.vllm.config import VllmEngineConfig
from shared.config import ConfigError, WorkerConfig
from shared.config_fields import flag_name

DEFAULT_OTLP_TRACES_ENDPOINT = "http://localhost:4318/v1/traces"  # the OTLP/HTTP exporter's default

# vLLM-CPU's thread binding syntax: "auto" (vLLM picks cores of a NUMA node and keeps one
# for its scheduler), "nobind", or core ids such as "1", "0-3" or "0,2,4-7", one list per
# tensor-parallel rank separated by "|" ("0|1").
_CORE_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class VllmEngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    model_dir: str
    served_model_name: str = ""  # empty: the model directory's name
    model_version: str = ""  # part of the compatibility hash (pairs workers during upgrades)
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_cache_gib: float = 1.0  # KV cache size; on CPU it is host memory
    block_size: int | None = None  # None: the platform's choice (128 on CPU)
    tensor_parallel: int = 1  # ranks (model-worker processes) splitting the KV heads
    enforce_eager: bool = True  # no CUDA graph capture (nothing to capture on CPU)
    json_any_whitespace: bool = True  # structured JSON may hold whitespace (vLLM's default)
    dtype: str = "auto"  # model dtype; "auto" follows the config (vLLM-CPU runs float32 as bfloat16)
    cpu_threads_bind: str = "auto"
    seed: int = 0
    kv_event_buffer_steps: int = 10_000  # batches vLLM keeps to replay after a gap
    kv_event_replay_timeout_s: float = 2.0
    kv_connector: KvConnectorOptions | None = None  # None: no KV transfer, vLLM computes everything
    encoder_cache: EncoderCacheSettings | None = None  # None: every worker encodes its images itself
    otlp_traces_endpoint: str = ""  # vLLM's own request spans, as children of Tandem's; "": none
    max_loras: int = 0  # LoRA adapters resident at once; 0: LoRA off
    max_lora_rank: int = 16
    adapter_dir: str = ""  # one PEFT directory per adapter name

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_gib * (1 << 30))

    def validate(self) -> None:
        if not self.model_dir:
            raise ConfigError(f"the vLLM engine needs a model directory ({flag_name(WorkerConfig, 'model_dir')})")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(f"{self.model_dir!r} is not a model directory (no config.json)")
        if self.max_model_len <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("max_model_len and max_num_seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be positive")
        if self.kv_cache_gib <= 0:
            raise ConfigError("the vLLM KV cache size must be positive")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.tensor_parallel < 1:
            raise ConfigError("the tensor-parallel degree must be at least 1")
        ranks = self.cpu_threads_bind.split("|")
        if self.cpu_threads_bind not in ("auto", "nobind") and (
                not all(_CORE_LIST.match(rank) for rank in ranks) or len(ranks) not in (1, self.tensor_parallel)):
            raise ConfigError(f"cpu_threads_bind must be 'auto', 'nobind' or core ids like '0-3' (one list per "
                              f"tensor-parallel rank, '|' between them), got {self.cpu_threads_bind!r}")
        if self.kv_event_buffer_steps <= 0 or self.kv_event_replay_timeout_s <= 0:
            raise ConfigError("the KV event replay buffer and timeout must be positive")
        if self.kv_connector is not None:
            self.kv_connector.validate()
        if self.encoder_cache is not None:
            self.encoder_cache.validate()
        if self.max_loras < 0 or self.max_lora_rank <= 0:
            raise ConfigError("max_loras must not be negative, max_lora_rank must be positive")

    @classmethod
    def from_worker_config(cls, config: WorkerConfig, vllm: VllmEngineConfig = VllmEngineConfig()) -> VllmEngineOptions:
        """The worker's settings and vLLM's own (`vllm`, the `--vllm-*` flags)."""
        transfer = config.kv_transfer
        if config.kv_host_blocks and not transfer.enabled:
            raise ConfigError("a host-memory KV tier (--kv-host-blocks) lives in Tandem's KV connector: "
                              "it needs KV transfer enabled")
        connector = KvConnectorOptions(agent_name_prefix=config.worker_id,
                                       progress_delay_us=transfer.progress_delay_us,
                                       transfer_timeout_s=transfer.transfer_timeout_s,
                                       control_timeout_s=transfer.control_timeout_s,
                                       faults=transfer.faults,
                                       retry=transfer.retry,
                                       host_blocks=config.kv_host_blocks) if transfer.enabled else None
        if config.pipeline_parallel != 1:
            raise ConfigError("the vLLM engine runs tensor parallelism only here: --pipeline-parallel must be 1")
        return cls(model_dir=config.model_dir, served_model_name=config.served_model_name,
                   model_version=config.model_version, tensor_parallel=config.tensor_parallel,
                   max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   kv_cache_gib=vllm.kv_cache_gib, block_size=vllm.block_size or None,
                   enforce_eager=vllm.enforce_eager, dtype=vllm.dtype, json_any_whitespace=vllm.json_any_whitespace,
                   cpu_threads_bind=vllm.cpu_threads_bind, kv_connector=connector,
                   max_loras=config.max_adapters, max_lora_rank=vllm.max_lora_rank,
                   adapter_dir=config.adapter_dir, encoder_cache=encoder_cache_settings(config, vllm),
                   otlp_traces_endpoint=(config.tracing.otlp_endpoint or DEFAULT_OTLP_TRACES_ENDPOINT)
                   if config.tracing.exporter == "otlp" else "")


def encoder_cache_settings(config: WorkerConfig, vllm: VllmEngineConfig) -> EncoderCacheSettings | None:
    """The encoder-cache store of `--vllm-encoder-cache-dir`, a folder per model and version."""
    if not vllm.encoder_cache_dir:
        return None
    model = config.served_model_name or Path(config.model_dir).resolve().name
    return EncoderCacheSettings(root=vllm.encoder_cache_dir, namespace=f"{model}@{config.model_version}",
                                budget_bytes=int(vllm.encoder_cache_gib * (1 << 30)))


def rank_threads_bind(bind: str, tensor_parallel: int, cores: list[int]) -> str:
    """vLLM-CPU's binding for every rank of an engine: as given when it already names one
    core list per rank, or "nobind"; else each rank gets its share of the given cores (or of
    `cores`, the process's, for "auto": vLLM's own choice needs one NUMA node per rank),
    round-robin, a core shared when there are fewer cores than ranks."""
    if tensor_parallel == 1 or bind == "nobind" or "|" in bind:
        return bind
    pool = sorted(cores) if bind == "auto" else _expand(bind)
    groups = [pool[rank::tensor_parallel] or [pool[rank % len(pool)]] for rank in range(tensor_parallel)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def bound_cores(bind: str) -> set[int]:
    """Every core a binding from `rank_threads_bind` names, all ranks together; none for
    "auto" and "nobind" (vLLM chooses, or binds nothing)."""
    if bind in ("auto", "nobind"):
        return set()
    return {core for rank in bind.split("|") for core in _expand(rank)}


def _expand(core_list: str) -> list[int]:
    cores: list[int] = []
    for part in core_list.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores
