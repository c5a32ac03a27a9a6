"""The sweep's seam to the systems it measures: a launcher starts one system for one run and
yields a `System` (where to send requests, how to read its counters, its worker ids); leaving
the context stops it.

`local_stack` is Tandem's launcher: a fresh `LocalStack` of workers of role `both` (sim, or
the engine the spec names: its registration sizes its KV cache, `EngineSpec.kv_cache_settings`,
and pins it to a core where it wants one) with the arm's router settings and the run's KV pool
size, so no cache carries over from one run to the next. Another system (NVIDIA Dynamo's frontend and engines) plugs in as another
launcher under its system name (`Arm.system`); a system without Tandem's counters yields
`counters=None` and its rows carry latency figures only. A launcher that cannot start raises
`LaunchError`: the row says so and the sweep goes on. Called by `bench.routing.sweep`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.routing.arms import Arm
from bench.routing.client import router_client
from bench.routing.counters import CountersReader, metrics_reader
from bench.routing.fleet_shapes import worker_groups
from bench.routing.workloads import EngineShape
from launch.definition import HttpService, Membership, Settings, StackDefinition
from launch.plan import plan_stack
from launch.stack import LocalStack


class LaunchError(RuntimeError):
    """The system did not start; the message says why."""


@dataclass(frozen=True)
class System:
    base_url: str  # an OpenAI-compatible endpoint
    model: str
    counters: CountersReader | None  # the workers' cumulative counters; None if the system has none
    worker_ids: tuple[str, ...]  # what the oracle pins to (empty: the system cannot pin)
    pids: tuple[int, ...] = ()  # processes whose CPU time the row reports
    client: Callable[[str], httpx.AsyncClient] = router_client  # the HTTP client its endpoint wants


@dataclass(frozen=True)
class LaunchSpec:
    """What one run needs started."""

    label: str  # "<point>-<arm>", for logs
    arm: Arm
    shape: EngineShape
    kv_blocks: int  # per worker
    model_dir: str
    worker_settings: Settings  # worker options besides the KV cache's size and sim_speedup
    log_dir: Path
    kv_host_blocks: int = 0  # per worker, in a host-memory tier behind its pool (0: none)
    engine: str = "sim"


Launcher = Callable[[LaunchSpec], AbstractContextManager[System]]


def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def cluster_worker_ids(metrics_url: str, expected: int, timeout_s: float = 15.0) -> tuple[str, ...]:
    """The worker ids the metrics collector lists, once it lists `expected` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = httpx.get(f"{metrics_url}/cluster", timeout=10).json()["workers"]
        if len(workers) >= expected:
            return tuple(sorted(worker["worker_id"] for worker in workers))
        if time.monotonic() > deadline:
            raise LaunchError(f"the metrics collector lists {len(workers)} of {expected} workers")
        time.sleep(0.2)


@contextmanager
def local_stack(spec: LaunchSpec) -> Iterator[System]:
    """Tandem on this machine: a fresh LocalStack for one run."""
    from services.worker.engines import engine_spec

    shape = spec.shape
    shutil.rmtree(spec.log_dir, ignore_errors=True)
    kv_cache = engine_spec(spec.engine).kv_cache_settings(spec.kv_blocks, shape.block_size, spec.model_dir)
    settings = {**spec.worker_settings, **kv_cache, "sim_speedup": shape.sim_speedup,
                **({"kv_host_blocks": spec.kv_host_blocks} if spec.kv_host_blocks else {})}
    if shape.mix and spec.engine != "sim":
        raise LaunchError("mixed worker shapes (--shapes) run on the sim")
    workers = worker_groups(shape.workers, shape.mix, engine=spec.engine, settings=settings,
                            block_size=shape.block_size, kv_blocks=spec.kv_blocks)
    definition = StackDefinition(name=spec.label, model_dir=spec.model_dir, workers=workers,
                                 membership=Membership(heartbeat_interval_s=0.5, ttl_s=5.0),
                                 router=HttpService(port=0, health="/health", settings=spec.arm.settings),
                                 metrics=HttpService(port=0, health="/metrics"))
    stack = LocalStack(plan_stack(definition, log_dir=str(spec.log_dir), cores=sorted(os.sched_getaffinity(0))))
    try:
        stack.start()
        pids = [process.pid for process in stack.processes.values()]
        if stack.nats is not None and stack.nats.process is not None:
            pids.append(stack.nats.process.pid)
        system = System(base_url=stack.router_url, model=served_model(stack.router_url),
                        counters=metrics_reader(stack.metrics_url),
                        worker_ids=cluster_worker_ids(stack.metrics_url, shape.workers), pids=tuple(pids))
    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as error:
        stack.stop()
        raise LaunchError(f"the stack did not start: {error}") from error
    try:
        yield system
    finally:
        stack.stop()


def _dynamo(spec: LaunchSpec) -> AbstractContextManager[System]:
    from bench.routing.dynamo_system import dynamo_stack  # only when a Dynamo arm runs

    return dynamo_stack(spec)


LAUNCHERS: dict[str, Launcher] = {"tandem": local_stack, "dynamo": _dynamo}


def cpu_seconds(pids: list[int] | tuple[int, ...]) -> float:
    """CPU seconds used so far by `pids` (Linux /proc) and by this process."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total
