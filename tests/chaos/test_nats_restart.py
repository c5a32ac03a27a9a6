"""NATS SIGKILLed under load and restarted on the same port one second later.

A real nats-server (its own process, its own store directory), a real router, two real
sim workers and the orchestrator (each on its own connection). Eight greedy streams are mid-generation when the
server is killed. After the restart, every one of them must either complete with exactly
the text an undisturbed run gives (resumed where frames were lost) or end with an explicit
error, within 5 s of the restart plus the time an undisturbed run of the eight takes (the
rest of a resumed stream's tokens): none hung, truncated or wrong. A new request must succeed
within 2 s of the restart, and neither the router nor the orchestrator may remove a live worker.

`TANDEM_NATS_RESTART_RUNS` sets how many times the scenario runs (3 by default).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time

import httpx
import pytest

from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.service import OrchestratorService
from services.router.main import RouterServer
from services.worker.sim.config import SimEngineConfig
from shared.bus import connect
from shared.config import BusConfig, MembershipConfig
from shared.nats_server import EmbeddedNats
from shared.tokenizer import Tokenizer
from tests.integration.router_cluster import (
    DEADLINE_S,
    MODEL_DIR_NAME,
    check_idle,
    launch_worker,
    router_config,
    worker_config,
)
from tests.waiting import wait_for

RUNS = int(os.environ.get("TANDEM_NATS_RESTART_RUNS", "3"))
STREAMS = 8
MAX_TOKENS = 120
# Every stream open at the kill has ended this long after the restart, plus the time the
# undisturbed run of all of them took (a resumed stream still has the rest of its tokens to
# make: on a slow or loaded host that takes longer, and is no hang).
RESTART_BOUND_S = 5.0
NEW_REQUEST_BOUND_S = 2.0  # a new request succeeds this long after the restart


def prompt(index: int) -> str:
    return f"request {index}: the quick brown fox jumps over the lazy dog, again and again"


async def stream_completion(http: httpx.AsyncClient, index: int, progress: dict[int, int]) -> dict:
    """One streamed completion: its text, finish reason, error (if any) and when it ended."""
    body = {"model": MODEL_DIR_NAME, "prompt": prompt(index), "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "stream": True}
    text, finish_reason, error = [], None, None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": (await response.aread()).decode(),
                    "ended_at": time.monotonic(), "text": "", "finish_reason": None}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                error = event["error"]
                continue
            choice = event["choices"][0]
            text.append(choice["text"])
            progress[index] = progress.get(index, 0) + 1
            finish_reason = choice.get("finish_reason") or finish_reason
    return {"status": 200, "text": "".join(text), "finish_reason": finish_reason, "error": error,
            "ended_at": time.monotonic()}


@pytest.mark.parametrize("run", range(RUNS))
async def test_streams_end_promptly_and_workers_stay_when_nats_restarts_under_load(
        run: int, tmp_path, model_dir: str, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.router.fleet.worker_pool")
    caplog.set_level(logging.INFO, logger="services.orchestrator.service")
    nats = EmbeddedNats(str(tmp_path / "nats")).start()
    bus_config = BusConfig(nats_url=nats.url, namespace=f"chaos{run}")
    test_bus = await connect(nats.url, "test-client")
    membership = MembershipConfig(heartbeat_interval_s=0.2, ttl_s=2.0)
    workers = [await launch_worker(worker_config(worker_id, bus_config, model_dir, membership=membership,
                                                 load_interval_s=0.1), test_bus, tokenizer,
                                   sim=SimEngineConfig(speedup=10.0))
               for worker_id in ("w1", "w2")]
    orchestrator_bus = await connect(nats.url, "orchestrator")
    orchestrator = OrchestratorService(OrchestratorConfig(bus=bus_config, membership=membership), orchestrator_bus)
    await orchestrator.start()
    server = RouterServer(router_config(bus_config, model_dir, membership=membership, idle_timeout_s=60.0))
    task = asyncio.create_task(server.serve())
    try:
        await asyncio.wait_for(server.listening.wait(), DEADLINE_S)
        async with httpx.AsyncClient(base_url=server.url, timeout=90) as http:
            async def both_workers() -> bool:
                return (await http.get("/health")).json()["worker_count"] == 2

            await wait_for(both_workers, DEADLINE_S, "the router to see both workers")
            # What an undisturbed run answers (the sim is deterministic), and how long it takes.
            started = time.monotonic()
            expected = await asyncio.gather(*(stream_completion(http, index, {}) for index in range(STREAMS)))
            undisturbed_s = time.monotonic() - started
            assert all(result["error"] is None and result["finish_reason"] == "length" for result in expected)

            worker_counts: list[int] = []
            watching = True

            async def watch_members() -> None:
                while watching:
                    response = await http.get("/health")
                    worker_counts.append(response.json()["worker_count"])
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch_members())
            progress: dict[int, int] = {}
            streams = [asyncio.create_task(stream_completion(http, index, progress)) for index in range(STREAMS)]
            await wait_for(lambda: len(progress) == STREAMS and min(progress.values()) >= 3, DEADLINE_S,
                           lambda: f"every stream under way (progress {progress})")
            assert not any(stream.done() for stream in streams), f"streams too short ({undisturbed_s:.2f}s)"
            await asyncio.to_thread(nats.kill)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(nats.start)  # same port, same store directory
            restarted_at = time.monotonic()

            # A new request succeeds within the bound (refusals while the workers re-register are fine).
            async def new_request_served() -> bool:
                response = await http.post("/v1/completions", json={"model": MODEL_DIR_NAME, "prompt": "hi",
                                                                     "max_tokens": 3})
                assert response.status_code in (200, 429, 502, 503), response.text
                return response.status_code == 200

            await wait_for(new_request_served, NEW_REQUEST_BOUND_S + 0.5, "a new request served after the restart",
                           interval_s=0.05)
            new_request_s = time.monotonic() - restarted_at

            bound_s = RESTART_BOUND_S + undisturbed_s
            done, pending = await asyncio.wait(streams, timeout=restarted_at + bound_s - time.monotonic())
            for stream in pending:
                stream.cancel()
            assert not pending, f"{len(pending)} streams still open {bound_s:.1f}s after the restart " \
                                f"(progress {progress}; the undisturbed run took {undisturbed_s:.1f}s)"
            watching = False
            await watcher
            results = [stream.result() for stream in streams]

        completed = errors = 0
        for index, (result, reference) in enumerate(zip(results, expected)):
            assert result["ended_at"] <= restarted_at + bound_s
            if result["error"] is None and result["status"] == 200:
                assert (result["text"], result["finish_reason"]) == (reference["text"], "length"), \
                    f"stream {index} completed wrong or truncated"
                completed += 1
            else:  # an explicit error: an SSE error event or an error status, with a message
                error = result["error"]
                assert error, f"stream {index} ended without an answer or an error"
                errors += 1
        logging.getLogger(__name__).warning("run %d: %d completed, %d explicit errors, new request after %.2fs",
                                            run, completed, errors, new_request_s)
        assert new_request_s <= NEW_REQUEST_BOUND_S, f"first new request served {new_request_s:.2f}s after"
        removed = [record.getMessage() for record in caplog.records if "left the cluster" in record.getMessage()
                   or "was not put back" in record.getMessage() or " removed (" in record.getMessage()]
        assert not removed, removed
        assert min(worker_counts) == 2, "the router dropped a live worker"
        assert all(worker.service.registration().started_at == worker.service._started_at for worker in workers)
        await check_idle(workers)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        await orchestrator.stop()
        await orchestrator_bus.close()
        for worker in workers:
            await worker.shutdown()
        await test_bus.close()
        nats.stop()
        shutil.rmtree(tmp_path / "nats", ignore_errors=True)
