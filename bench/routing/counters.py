"""The cluster's prompt and cache counters, read from the metrics collector's `/cluster`
(the workers' load snapshots), and the hit and pull rates of a run from two readings.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from bench.routing.client import progress

SETTLE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Counters:
    prompt: int
    cached: int
    pulled: int
    busy: int  # running + waiting
    per_worker_prompt: dict[str, int]


async def read_counters(http: httpx.AsyncClient, metrics_url: str) -> Counters:
    cluster = (await http.get(f"{metrics_url}/cluster")).json()
    workers = cluster["workers"]
    return Counters(prompt=sum(worker["prompt_tokens_total"] for worker in workers),
                    cached=sum(worker["cached_tokens_total"] for worker in workers),
                    pulled=sum(worker["kv_pulled_tokens_total"] for worker in workers),
                    busy=sum(worker["running"] + worker["waiting"] for worker in workers),
                    per_worker_prompt={worker["worker_id"]: worker["prompt_tokens_total"] for worker in workers})


async def settled_counters(http: httpx.AsyncClient, metrics_url: str) -> Counters:
    """Counters once every worker is idle and two load snapshots in a row agree."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = await read_counters(http, metrics_url)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.6)  # load snapshots come every 0.25 s
        now = await read_counters(http, metrics_url)
        if now.busy == 0 and now == last:
            return now
        last = now
    return last


def cache_figures(before: Counters, after: Counters) -> dict:
    prompt = after.prompt - before.prompt
    share = {worker: after.per_worker_prompt.get(worker, 0) - before.per_worker_prompt.get(worker, 0)
             for worker in after.per_worker_prompt}
    progress("  prompt tokens per worker: " + ", ".join(f"{worker}={tokens}" for worker, tokens in share.items()))
    return {"hit_rate": round((after.cached - before.cached) / prompt, 4) if prompt else None,
            "pull_rate": round((after.pulled - before.pulled) / prompt, 4) if prompt else None}
