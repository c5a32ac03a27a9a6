"""NVIDIA Dynamo as a system of the routing sweep: the launcher for its arms ("dynamo-kv",
"dynamo-round-robin"), registered in `bench.routing.systems.LAUNCHERS` under "dynamo".

One run gets a fresh `DynamoStack` (its frontend and KV router in front of mocker engines)
with the sweep's engine shape: as many engines as Tandem's sim workers, the same KV pool per
worker, block size, batch limits, and the sim's own timing profile and speed-up
(`dynamo_timing.mocker_settings`), so each router works on engines of the same speed; each is
compared with its own plain baseline, never figure for figure with Tandem. Its counters are the
frontend's prompt and cached tokens (one figure for the whole cluster: no per-worker split,
no pulls, Dynamo has none); it exposes no worker ids, so the oracle arm cannot pin to it. The
client opens a connection per request (`dynamo.dynamo_client`: Dynamo's HTTP server leaves
Nagle's algorithm on, which would add ~40 ms to every TTFT on a kept-alive connection).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from bench.routing.counters import Counters, CountersReader, WorkerCounters
from bench.routing.dynamo import DynamoStack, DynamoUnavailable, dynamo_client
from bench.routing.dynamo_counters import parse_counters
from bench.routing.dynamo_timing import mocker_settings
from bench.routing.systems import LaunchError, LaunchSpec, System

CLUSTER = "(cluster)"  # the one pseudo-worker Dynamo's counters describe


def dynamo_reader(base_url: str) -> CountersReader:
    async def read(http: httpx.AsyncClient) -> Counters:
        figures = parse_counters((await http.get(f"{base_url}/metrics", timeout=10)).text)
        whole = WorkerCounters(prompt=figures.prompt_tokens, cached=figures.cached_tokens)
        return Counters(prompt=figures.prompt_tokens, cached=figures.cached_tokens, pulled=0, busy=0,
                        per_worker_prompt={CLUSTER: figures.prompt_tokens}, per_worker={CLUSTER: whole})
    return read


@contextmanager
def dynamo_stack(spec: LaunchSpec) -> Iterator[System]:
    max_num_seqs = spec.worker_settings.get("max_num_seqs")
    settings = mocker_settings(spec.shape, max_num_seqs=int(max_num_seqs) if max_num_seqs else None)
    try:
        stack = DynamoStack(spec.model_dir, kv_blocks=spec.kv_blocks, router_mode=spec.arm.settings["router_mode"],
                            log_dir=spec.log_dir, **settings)
        stack.start()
    except (DynamoUnavailable, RuntimeError, TimeoutError, OSError) as error:
        raise LaunchError(f"Dynamo did not start: {error}") from error
    try:
        yield System(base_url=stack.base_url, model=stack.model, counters=dynamo_reader(stack.base_url),
                     worker_ids=(), pids=tuple(stack.pids), client=dynamo_client)
    finally:
        stack.stop()
