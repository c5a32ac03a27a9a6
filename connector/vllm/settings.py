"""The settings of Tandem's vLLM KV connector and of its encoder-cache connector: built by
the worker (from `WorkerConfig`, in `services/worker/vllm/options.py`), carried to vLLM's
processes in `kv_connector_extra_config` (`tandem_connector.ConnectorSettings`) and
`ec_connector_extra_config`. Pure data; no vLLM import.
"""

from __future__ import annotations

import msgspec

from shared.config import ConfigError, KvFaultConfig, KvRetryConfig


class KvConnectorOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Tandem's KV connector inside vLLM (`connector.vllm.tandem_connector`)."""

    agent_name_prefix: str = "tandem"  # the NIXL agent is "<prefix>-<random>", fresh per start
    progress_delay_us: int = 10_000  # NIXL progress thread wake-up; never 0 (it would spin a core)
    transfer_timeout_s: float = 10.0  # one pull's READ, inside a model step
    control_timeout_s: float = 2.0  # waits for the connector's reports (pins, load outcomes)
    faults: KvFaultConfig = KvFaultConfig()
    retry: KvRetryConfig = KvRetryConfig()  # failed blocks read again before vLLM computes them
    host_blocks: int = 0  # blocks of a host-memory tier behind vLLM's cache (`host_scheduler`); 0: none

    def validate(self) -> None:
        if self.progress_delay_us <= 0:
            raise ConfigError("progress_delay_us must be positive (0 spins a core)")
        if self.transfer_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ConfigError("KV connector timeouts must be positive")
        if self.host_blocks < 0:
            raise ConfigError("host_blocks must not be negative")
        self.faults.validate()
        self.retry.validate()


class EncoderCacheSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Tandem's encoder-cache connector inside vLLM (`connector.vllm.encoder_cache`), carried
    in `ec_connector_extra_config`."""

    root: str  # the directory the workers of the model share
    namespace: str  # the model and its version: another model's encoder gives other outputs
    budget_bytes: int  # the store's size; the least recently used entries go past it
    grace_s: float = 60.0  # an entry used this recently is never evicted (a load may follow)

    def validate(self) -> None:
        if self.budget_bytes <= 0:
            raise ConfigError("the encoder cache's size must be positive")
