"""The cluster's prompt and cache counters, read from the metrics collector's `/cluster`
(the workers' load snapshots), and a run's figures from two readings.

`cached_tokens_total` counts every prompt token found in a worker's prefix cache when the
request was admitted, including blocks that a prefix pull had just brought in: local hits are
cached minus pulled. `cache_figures` gives the plain bench's hit and pull rates;
`sweep_figures` the sweep's split (local / pulled shares, recomputed and computed tokens,
evictions, load imbalance across workers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import httpx

from bench.routing.client import progress

SETTLE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WorkerCounters:
    prompt: int = 0
    cached: int = 0
    pulled: int = 0
    recomputed: int = 0
    computed: int = 0
    generated: int = 0
    evicted: int = 0
    evicted_missed: int = 0

    def minus(self, other: WorkerCounters) -> WorkerCounters:
        return WorkerCounters(**{name: getattr(self, name) - getattr(other, name)
                                 for name in self.__dataclass_fields__})


@dataclass(frozen=True)
class Counters:
    prompt: int
    cached: int
    pulled: int
    busy: int  # running + waiting
    per_worker_prompt: dict[str, int]
    per_worker: dict[str, WorkerCounters] = field(default_factory=dict)


CountersReader = Callable[[httpx.AsyncClient], Awaitable[Counters]]


def counters_from_cluster(cluster: dict) -> Counters:
    workers = cluster["workers"]
    per_worker = {worker["worker_id"]: WorkerCounters(
        prompt=worker["prompt_tokens_total"], cached=worker["cached_tokens_total"],
        pulled=worker.get("kv_pulled_tokens_total", 0), recomputed=worker.get("kv_recomputed_tokens_total", 0),
        computed=worker.get("computed_prompt_tokens_total", 0), generated=worker.get("generated_tokens_total", 0),
        evicted=worker.get("kv_evicted_blocks_total", 0),
        evicted_missed=worker.get("kv_evicted_missed_blocks_total", 0)) for worker in workers}
    return Counters(prompt=sum(worker["prompt_tokens_total"] for worker in workers),
                    cached=sum(worker["cached_tokens_total"] for worker in workers),
                    pulled=sum(worker["kv_pulled_tokens_total"] for worker in workers),
                    busy=sum(worker["running"] + worker["waiting"] for worker in workers),
                    per_worker_prompt={worker["worker_id"]: worker["prompt_tokens_total"] for worker in workers},
                    per_worker=per_worker)


async def read_counters(http: httpx.AsyncClient, metrics_url: str) -> Counters:
    return counters_from_cluster((await http.get(f"{metrics_url}/cluster")).json())


def metrics_reader(metrics_url: str) -> CountersReader:
    """A `CountersReader` for a Tandem metrics collector at `metrics_url`."""
    async def read(http: httpx.AsyncClient) -> Counters:
        return await read_counters(http, metrics_url)
    return read


async def settled(http: httpx.AsyncClient, read: CountersReader) -> Counters:
    """Counters once every worker is idle and two load snapshots in a row agree."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = await read(http)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.6)  # load snapshots come every 0.25 s
        now = await read(http)
        if now.busy == 0 and now == last:
            return now
        last = now
    return last


async def settled_counters(http: httpx.AsyncClient, metrics_url: str) -> Counters:
    return await settled(http, metrics_reader(metrics_url))


def cache_figures(before: Counters, after: Counters) -> dict:
    prompt = after.prompt - before.prompt
    share = {worker: after.per_worker_prompt.get(worker, 0) - before.per_worker_prompt.get(worker, 0)
             for worker in after.per_worker_prompt}
    progress("  prompt tokens per worker: " + ", ".join(f"{worker}={tokens}" for worker, tokens in share.items()))
    return {"hit_rate": round((after.cached - before.cached) / prompt, 4) if prompt else None,
            "pull_rate": round((after.pulled - before.pulled) / prompt, 4) if prompt else None}


def imbalance(values: Mapping[str, float]) -> float | None:
    """Max over mean across workers (1.0: perfectly even); None when nothing was done."""
    if not values:
        return None
    mean = sum(values.values()) / len(values)
    return round(max(values.values()) / mean, 3) if mean > 0 else None


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def sweep_figures(before: Counters, after: Counters) -> dict:
    """The sweep row's cache, eviction and balance figures for the run between two readings."""
    empty = WorkerCounters()
    delta = {worker: counters.minus(before.per_worker.get(worker, empty))
             for worker, counters in after.per_worker.items()}
    total = WorkerCounters(**{name: sum(getattr(counters, name) for counters in delta.values())
                              for name in WorkerCounters.__dataclass_fields__})
    local = max(0, total.cached - total.pulled)
    return {
        "prompt_tokens": total.prompt,
        "cached_share": _share(total.cached, total.prompt),
        "local_share": _share(local, total.prompt),
        "pulled_share": _share(total.pulled, total.prompt),
        "pulled_tokens": total.pulled,
        "recomputed_tokens": total.recomputed,
        "computed_prompt_tokens": total.computed,
        "evicted_blocks": total.evicted,
        "evicted_missed_blocks": total.evicted_missed,
        # (a system whose counters cover the whole cluster at once has no balance figures)
        "computed_imbalance": imbalance({worker: counters.computed for worker, counters in delta.items()})
        if len(delta) > 1 else None,
        # every request generates max_tokens (ignore_eos): generated tokens stand for requests
        "request_imbalance": imbalance({worker: counters.generated for worker, counters in delta.items()})
        if len(delta) > 1 else None,
        "per_worker_computed": {worker: counters.computed for worker, counters in delta.items()},
    }
