"""The systems `tandem bench router` compares, each as a context manager yielding a
`RouterSystem`: where to send requests (one URL per router process) and which processes
are the router (whose CPU time per request is reported).

- `tandem_system(routers, ...)`: a `LocalStack` of sim workers of role both at the bench's
  speed-up, its router processes (several share one port: the kernel spreads connections
  over them, and they share their predicted load over NATS), orchestrator and metrics
  collector. A count outside 1..`MAX_ROUTERS` is an `UnsupportedRouters`.
- `dynamo_system(...)`: Dynamo's frontend (HTTP, tokenizer, KV router) in front of its mocker
  engines (`bench.routing.dynamo.DynamoStack`); its router process is the frontend.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.routing.dynamo import DynamoStack
from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack

MAX_ROUTERS = 16


class UnsupportedRouters(ValueError):
    """A router count the bench does not start."""


@dataclass(frozen=True)
class RouterSystem:
    name: str
    base_urls: tuple[str, ...]  # one per router process; the client spreads requests over them
    model: str
    router_pids: tuple[int, ...]  # the processes whose CPU time is the router's


@dataclass(frozen=True)
class EngineSetup:
    """What both systems' engines look like."""

    workers: int = 2
    speedup: float = 1000.0
    block_size: int = 16
    kv_blocks: int = 512
    kv_event_interval_s: float = 0.0  # Tandem's workers; 0: their default


def check_router_count(routers: int) -> None:
    if not 1 <= routers <= MAX_ROUTERS:
        raise UnsupportedRouters(f"{routers} router processes: the bench starts 1 to {MAX_ROUTERS}")


def _served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


@contextmanager
def tandem_system(routers: int, model_dir: str, log_dir: Path, engines: EngineSetup = EngineSetup(),
                  ) -> Iterator[RouterSystem]:
    check_router_count(routers)
    settings = {"sim_speedup": engines.speedup, "kv_blocks": engines.kv_blocks}
    if engines.kv_event_interval_s:
        settings["kv_event_interval"] = engines.kv_event_interval_s
    workers = tuple(WorkerSpec(worker_id=f"w{i + 1}", settings=settings) for i in range(engines.workers))
    config = StackConfig(model_dir=model_dir, engine="sim", workers=workers, router_port=0, metrics_port=0,
                         namespace="benchrouter" + uuid.uuid4().hex[:8], log_dir=str(log_dir), routers=routers)
    stack = LocalStack(config)
    stack.start()
    try:
        router_pids = tuple(process.pid for name, process in stack.processes.items()
                            if name == "router" or name.startswith("router-"))
        yield RouterSystem(name="tandem", base_urls=(stack.router_url,), model=_served_model(stack.router_url),
                           router_pids=router_pids)
    finally:
        stack.stop()


@contextmanager
def dynamo_system(model_dir: str, log_dir: Path, engines: EngineSetup = EngineSetup(),
                  venv: str | os.PathLike[str] | None = None) -> Iterator[RouterSystem]:
    stack = DynamoStack(model_dir, workers=engines.workers, block_size=engines.block_size,
                        kv_blocks=engines.kv_blocks, speedup_ratio=engines.speedup, router_mode="kv",
                        log_dir=log_dir, venv=venv)
    with stack:
        yield RouterSystem(name="dynamo", base_urls=(stack.base_url,), model=stack.model,
                           router_pids=(stack.processes["frontend"].pid,))
