"""A fleet of unlike shapes through the router's HTTP API (real nats-server, sim workers
with per-rank pools, KV over the in-memory transport): two prefill workers at TP 2 and two
decode workers at TP 4, the reverse, and a fleet mixing block sizes 16 and 32 with a
pipeline-split prefill worker. Every request is disaggregated, its KV pulled between unlike
ranks, and every answer equals a single engine's (the sim's tokens follow its KV bytes: a
block mapped to the wrong place perturbs them); nothing is left pinned or leased."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.router.config import RoutingConfig
from services.router.routing.config import ALWAYS_SPLIT
from shared.config import BusConfig
from shared.schemas import WorkerRole
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME

PROMPTS = [" ".join(f"{word}{i}" for word in ("river", "mill", "song", "water", "stone") * (6 + i % 5))
           for i in range(8)]
FLEETS = {  # (prefill workers' shapes, decode workers' shapes)
    "tp2-to-tp4": ([{"tensor_parallel": 2}] * 2, [{"tensor_parallel": 4}] * 2),
    "tp4-to-tp2": ([{"tensor_parallel": 4}] * 2, [{"tensor_parallel": 2}] * 2),
    "mixed": ([{"block_size": 16, "pipeline_parallel": 2}, {"block_size": 32, "tensor_parallel": 2}],
              [{"block_size": 32, "tensor_parallel": 4}, {"block_size": 16}]),
}


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[cluster.Router]:
    routing = RoutingConfig(kv_aware=ALWAYS_SPLIT)  # short prompts too: this is about the hand-off
    async with cluster.running_router(cluster.router_config(bus_config, model_dir, routing=routing)) as running:
        yield running


async def answers(router: cluster.Router) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=8)
        assert reply.choices[0].finish_reason == "length"
        texts.append(reply.choices[0].text)
    return texts


@pytest.mark.parametrize("fleet", list(FLEETS))
async def test_a_fleet_of_unlike_shapes_answers_as_one_engine(router: cluster.Router, start_worker,
                                                              fleet: str) -> None:
    solo = await start_worker("solo")
    await cluster.wait_for_workers(router, 1)
    expected = await answers(router)
    await solo.stop()
    await cluster.wait_for_workers(router, 0)

    prefill_shapes, decode_shapes = FLEETS[fleet]
    workers = [await start_worker(f"p{i}", role=WorkerRole.PREFILL, **shape) for i, shape in enumerate(prefill_shapes)]
    workers += [await start_worker(f"d{i}", role=WorkerRole.DECODE, **shape) for i, shape in enumerate(decode_shapes)]
    await cluster.wait_for_workers(router, 4)
    assert await answers(router) == expected
    await cluster.wait_until_idle(router)

    decoded = [request for worker in workers if worker.worker_id.startswith("d") for request in worker.requests]
    assert len(decoded) == len(PROMPTS)
    sources = [request.kv_transfer.source for request in decoded if request.kv_transfer is not None]
    assert len(sources) == len(PROMPTS) and all(source is not None for source in sources)  # every prompt pulled
    assert {source.holder_worker_id for source in sources if source is not None} <= {"p0", "p1"}
    text = await cluster.metrics_text(router)
    assert f'tandem_router_route_decisions_total{{flow="disaggregated",reason="pair"}} {float(len(PROMPTS))}' in text
    assert "tandem_router_kv_recomputed_tokens_total 0.0" in text
