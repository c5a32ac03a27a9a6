"""The router's readiness endpoint, which compose health checks use: `/health` (liveness)
answers 200 as soon as NATS is connected; `/ready` answers 503 until an active worker that
finishes requests (decode or both) serves the router's model. Needs no Docker."""

from __future__ import annotations

import asyncio

from shared.schemas import WorkerRole
from tests.integration.router_cluster import MODEL_DIR_NAME, Router, wait_for_workers

DEADLINE_S = 10.0


async def ready_status(router: Router) -> tuple[int, dict]:
    reply = await router.http.get("/ready")
    return reply.status_code, reply.json()


async def wait_ready_status(router: Router, code: int) -> dict:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while True:
        status, body = await ready_status(router)
        if status == code:
            return body
        assert asyncio.get_running_loop().time() < deadline, f"/ready never answered {code}: {body}"
        await asyncio.sleep(0.01)


async def test_ready_waits_for_a_worker_that_finishes_requests(router: Router, start_worker) -> None:
    assert (await router.http.get("/health")).status_code == 200
    status, body = await ready_status(router)
    assert status == 503 and body["serving_workers"] == [] and body["model"] == MODEL_DIR_NAME

    await start_worker("p1", role=WorkerRole.PREFILL)
    await start_worker("other", served_model_name="other-model")
    await start_worker("d0", role=WorkerRole.DECODE, draining=True)  # takes no new work
    await wait_for_workers(router, 3)
    assert (await ready_status(router))[0] == 503  # a prefill worker, another model's, a draining one

    await start_worker("d1", role=WorkerRole.DECODE)
    body = await wait_ready_status(router, 200)
    assert body["status"] == "ready" and body["serving_workers"] == ["d1"]
