"""The per-worker figures of docs/scale.md that the 1024-worker test does not print, measured
offline (no test, prints JSON): `.venv/bin/python -m tests.scale.measure [routing|memory|
subscriptions|heartbeats]` (all of them when none is named).

- routing: median CPU time to build the router's views of N workers and to `decide` one
  request over them (default kv-aware policy, a 64-token prompt held by a few workers);
- memory: bytes of Python objects per worker in the router (pool entry, KV index slot)
  and the collector (registration, load), and per stored block in the collector;
- subscriptions: NATS subscriptions and asyncio tasks of a fleet of 1 and of 64 workers,
  KV transfer on / off;
- heartbeats: a 1024-worker fleet process alone: heartbeats and load snapshots a second
  and the largest gap between two heartbeats of one worker, per 4 s window once all are
  registered.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import tracemalloc

from services.metrics.cluster_view import ClusterView
from services.router.config import RoutingConfig
from services.router.fleet.worker_state import WorkerState
from services.router.kv.index import KvIndex
from services.router.routing import RouteRequest, build_policy, decide
from services.worker.config import FleetConfig
from services.worker.fleet import WorkerFleet
from services.worker.sim.config import SimEngineConfig
from shared.bus import connect
from shared.config import BusConfig, KvTransferConfig, WorkerConfig
from shared.nats_server import EmbeddedNats
from shared.schemas import KvEventBatch, LoadSnapshot, WorkerCapacity, WorkerRegistration, WorkerRole, WorkerStatus
from shared.schemas.kv_events import BlockStored
from shared.subjects import Subjects
from shared.tiny_model import generate_tiny_model


def registration(index: int) -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=f"sim-{index:04d}", role=WorkerRole.BOTH, model="tiny", engine="sim", block_size=16,
        compat_hash="c0", model_version="", kv_transfer=True,
        capacity=WorkerCapacity(kv_blocks=256, max_num_seqs=64, max_model_len=2048),
        status=WorkerStatus.ACTIVE, started_at=0.0, heartbeat_at=0.0, pid=1, generation=0)


def load(index: int) -> LoadSnapshot:
    return LoadSnapshot(worker_id=f"sim-{index:04d}", seq=1, ts=0.0, running=0, waiting=0, kv_total_blocks=256,
                        kv_used_blocks=0, kv_cached_blocks=3, prompt_tokens_total=0, cached_tokens_total=0,
                        generated_tokens_total=0, pending_prefill_tokens=0)


def router_states(count: int) -> list[WorkerState]:
    states = []
    for index in range(count):
        state = WorkerState(registration(index))
        state.load = load(index)
        states.append(state)
    return states


def routing(sizes: tuple[int, ...] = (8, 64, 256, 1024), rounds: int = 60) -> dict:
    config = RoutingConfig()
    policy = build_policy(config)
    result: dict = {"views_ms": {}, "decide_ms": {}}
    for count in sizes:
        states = router_states(count)
        cached = {f"sim-{index:04d}": 48 for index in range(0, min(count, 20), 3)}
        views_s, decide_s = [], []
        for draw in range(rounds):
            started = time.process_time()
            views = [state.view() for state in states]
            views_s.append(time.process_time() - started)
            request = RouteRequest(model="tiny", prompt_tokens=64, total_tokens=68, cached_tokens=cached,
                                   held_tokens=cached, cache_hit_threshold=0.0, admit=True, draw=draw / rounds,
                                   route_hint=None, prefix_key=123, victim_age_s={})
            started = time.process_time()
            decide(views, request, config, policy)
            decide_s.append(time.process_time() - started)
        result["views_ms"][count] = round(sorted(views_s)[rounds // 2] * 1000, 3)
        result["decide_ms"][count] = round(sorted(decide_s)[rounds // 2] * 1000, 3)
    return result


def memory(count: int = 1024, blocks_per_worker: int = 200) -> dict:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        states, index = router_states(count), KvIndex()
        for state in states:
            index.add_worker(state.registration.worker_id, 16)
        router = (tracemalloc.get_traced_memory()[0] - base) / count
        base = tracemalloc.get_traced_memory()[0]
        view = ClusterView()
        for worker in range(count):
            view.apply_registration(registration(worker))
            view.apply_load(load(worker))
        collector = (tracemalloc.get_traced_memory()[0] - base) / count
        base = tracemalloc.get_traced_memory()[0]
        for worker in range(count):
            hashes = list(range(worker * 100_000, worker * 100_000 + blocks_per_worker))
            view.apply_kv(KvEventBatch(worker_id=f"sim-{worker:04d}", seq=1, ts=0.0, events=[
                BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16)]))
        per_block = (tracemalloc.get_traced_memory()[0] - base) / (count * blocks_per_worker)
    finally:
        tracemalloc.stop()
    return {"router_bytes_per_worker": round(router), "collector_bytes_per_worker": round(collector),
            "collector_bytes_per_stored_block": round(per_block)}


async def subscriptions(nats_url: str, model_dir: str) -> dict:
    result = {}
    for kv_transfer in (True, False):
        for count in (1, 64):
            worker = WorkerConfig(worker_id="template", model_dir=model_dir, kv_blocks=64,
                                  kv_transfer=KvTransferConfig(enabled=kv_transfer, transport="memory"),
                                  bus=BusConfig(nats_url=nats_url, namespace=f"subs{count}{int(kv_transfer)}"))
            fleet = WorkerFleet(FleetConfig(worker=worker, sim=SimEngineConfig(kv_dim=8), count=count))
            await fleet.start()
            result[f"kv_transfer={kv_transfer} workers={count}"] = {
                "subscriptions": sum(len(bus.client._subs) for bus in fleet._buses),
                "tasks": len(asyncio.all_tasks()) - 1}  # less this one
            await fleet.stop()
    return result


async def heartbeats(nats_url: str, model_dir: str, count: int = 1024, windows: int = 6) -> list[dict]:
    namespace = "heartbeats"
    fleet = subprocess.Popen([sys.executable, "-m", "cli.main", "worker-fleet", "--count", str(count),
                              "--model-dir", model_dir, "--nats-url", nats_url, "--namespace", namespace,
                              "--heartbeat-interval", "1", "--ttl", "10", "--log-level", "warning"])
    bus = await connect(nats_url, "measure")
    last: dict[str, float] = {}
    gaps: dict[str, float] = {}
    counts = {"heartbeats": 0, "loads": 0}

    async def on_heartbeat(msg) -> None:
        worker_id, now = msg.subject.rsplit(".", 1)[1], time.monotonic()
        if worker_id in last:
            gaps[worker_id] = max(gaps.get(worker_id, 0.0), now - last[worker_id])
        last[worker_id] = now
        counts["heartbeats"] += 1

    async def on_load(msg) -> None:
        counts["loads"] += 1

    subjects = Subjects(namespace)
    await bus.client.subscribe(f"$KV.{subjects.members_bucket}.>", cb=on_heartbeat)
    await bus.client.subscribe(subjects.load_all, cb=on_load)
    rows = []
    try:
        deadline = time.monotonic() + 120
        while len(last) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the poll interval: measure once every worker is registered
        for _ in range(windows):
            before = dict(counts)
            await asyncio.sleep(4.0)  # a measurement window
            rows.append({"workers": len(last), "heartbeats_per_s": (counts["heartbeats"] - before["heartbeats"]) / 4,
                         "loads_per_s": (counts["loads"] - before["loads"]) / 4,
                         "max_heartbeat_gap_s": round(max(gaps.values(), default=0.0), 2)})
            gaps.clear()
    finally:
        fleet.terminate()
        fleet.wait(30)
        await bus.close()
    return rows


def main(names: list[str]) -> None:
    names = names or ["routing", "memory", "subscriptions", "heartbeats"]
    result: dict = {}
    if "routing" in names:
        result["routing"] = routing()
    if "memory" in names:
        result["memory"] = memory()
    if "subscriptions" in names or "heartbeats" in names:
        model_dir = tempfile.mkdtemp() + "/tiny"
        generate_tiny_model(model_dir)
        with EmbeddedNats() as nats:
            if "subscriptions" in names:
                result["subscriptions"] = asyncio.run(subscriptions(nats.url, model_dir))
            if "heartbeats" in names:
                result["heartbeats"] = asyncio.run(heartbeats(nats.url, model_dir))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
