"""Engine load from vLLM's stat-logger hook.

`AsyncLLM(stat_loggers=[factory])` calls each logger's `record()` from its output-handler
task (on the worker's event loop) once per engine step, with the step's `SchedulerStats`
(running/waiting requests, KV usage as a fraction of usable blocks) and `IterationStats`
(tokens produced in the step; prompt and prefix-cache-hit tokens of requests whose prefill
finished in it). When the engine goes idle it sends one more `SchedulerStats`, so the last
values are current. vLLM warns that these classes are not a stable interface: everything
read from them is in `EngineStats.record()`.

`EngineStats` keeps the latest gauges and running totals; `VllmEngine.load()` reads it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats


class EngineStats:
    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0  # fraction of usable blocks referenced by requests
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0  # prompt tokens served from the prefix cache or a KV transfer
        self.computed_prompt_tokens_total = 0  # prompt tokens prefilled here (recomputation included)
        self.external_prompt_tokens_total = 0  # prompt tokens loaded by the KV connector
        self.generated_tokens_total = 0
        self.steps = 0  # SchedulerStats received

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.steps += 1
            self.running = scheduler_stats.num_running_reqs
            # Deferred ("skipped") waiting requests are queued all the same.
            self.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            self.prompt_tokens_total += prompt.total
            self.cached_tokens_total += prompt.cached_tokens
            self.computed_prompt_tokens_total += prompt.computed
            self.external_prompt_tokens_total += prompt.external_kv_transfer
            self.generated_tokens_total += iteration_stats.num_generation_tokens

    def stat_logger_factory(self) -> Any:
        """A per-engine factory `(vllm_config, engine_index) -> StatLoggerBase` for AsyncLLM."""
        return partial(_StatsLogger, stats=self)


class _StatsLogger(StatLoggerBase):
    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0, *, stats: EngineStats) -> None:
        self._stats = stats

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: MultiModalCacheStats | None = None, engine_idx: int = 0) -> None:
        self._stats.record(scheduler_stats, iteration_stats)

    def log_engine_initialized(self) -> None:
        pass
