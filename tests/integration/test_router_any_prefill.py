"""Any worker prefills for any other (`prefill_from` "any"), through the router's HTTP API
against a real nats-server and two all-round (BOTH) sim workers: the router serves a
request whole while nothing is in flight, and splits requests across the two workers while
one decodes: the other computes their prompts, and their decodes join the first's; the
split answer equals one worker's, the
hand-off is the prefill flow's own (lease, pull, release "done"), and the routing record
(metrics, span attributes) names the choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.router.config import RoutingConfig
from services.router.routing.config import ALWAYS_SPLIT
from shared.config import BusConfig
from shared.tokenizer import Tokenizer
from tests.integration import router_cluster as cluster
from tests.integration.router_cluster import MODEL_DIR_NAME
from tests.waiting import wait_for

# long enough that its stalled decodes cost more than a hand-off (cost.handoff_cost)
PROMPT = " ".join(f"The river ran past mill number {i}, and the miller sang to the water." for i in range(8))


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[cluster.Router]:
    routing = RoutingConfig(prefill_from="any", itl_weight=1.0, kv_aware=ALWAYS_SPLIT)
    async with cluster.running_router(cluster.router_config(bus_config, model_dir, routing=routing)) as running:
        yield running


async def complete(router: cluster.Router, prompt: str) -> tuple[str, str | None]:
    reply = await router.client.completions.create(model=MODEL_DIR_NAME, prompt=prompt, max_tokens=8)
    return reply.choices[0].text, reply.choices[0].finish_reason


async def test_a_both_worker_prefills_for_another_when_that_wins(router: cluster.Router, start_worker,
                                                                   tokenizer: Tokenizer) -> None:
    solo = await start_worker("solo")
    await cluster.wait_for_workers(router, 1)
    expected = await complete(router, PROMPT)
    await solo.stop()
    await cluster.wait_for_workers(router, 0)

    # a: three requests decoding (held after their second token); nothing else runs yet
    decoding = await start_worker("a", hold=True, hold_at=2)
    await cluster.wait_for_workers(router, 1)
    held = [asyncio.create_task(complete(router, f"{i} {PROMPT}")) for i in range(3)]
    await wait_for(lambda: len(decoding.requests) == 3, cluster.DEADLINE_S, "three requests on a")

    # b: every prompt waits before its first token. Both prompts are split: b computes them
    # (computing them on a would stall a's three decodes) and a decodes them (b, with the
    # fewest requests, is where the next prompts go, and its queue would delay every token)
    queued = await start_worker("b", stall=True)
    await cluster.wait_for_workers(router, 2)
    first = asyncio.create_task(complete(router, f"first {PROMPT}"))
    await wait_for(lambda: len(queued.requests) == 1, cluster.DEADLINE_S, "the first prompt on b")
    split = asyncio.create_task(complete(router, PROMPT))
    await wait_for(lambda: len(queued.requests) == 2, cluster.DEADLINE_S, "the second prompt on b")
    for prompt_part in queued.requests:
        assert prompt_part.kv_transfer is not None and prompt_part.kv_transfer.hold_for_decode
        assert prompt_part.sampling.max_tokens == 1

    queued.release()
    decoding.release()
    assert await asyncio.wait_for(split, cluster.DEADLINE_S) == expected
    await asyncio.wait_for(asyncio.gather(first, *held), cluster.DEADLINE_S)
    decode_parts = decoding.requests[3:]
    assert [part.request_id for part in decode_parts] == [part.request_id for part in queued.requests]
    for part in decode_parts:
        assert part.kv_transfer is not None and part.kv_transfer.source is not None
        assert part.kv_transfer.source.holder_worker_id == "b"
        lease_id = part.kv_transfer.source.lease_id
        await wait_for(lambda: queued.released(lease_id) == ["done"], cluster.DEADLINE_S, "a's release of b's lease")

    # nothing in flight any more: serving whole is cheaper than a hand-off
    await cluster.wait_until_idle(router)
    assert await complete(router, PROMPT) == expected
    await cluster.wait_until_idle(router)
    text = await cluster.metrics_text(router)
    assert 'tandem_router_route_decisions_total{flow="disaggregated",reason="pair"} 2.0' in text
    # solo's and a's three: one worker, none to split with
    assert 'tandem_router_route_decisions_total{flow="single",reason="one_worker"} 4.0' in text
    assert 'tandem_router_route_decisions_total{flow="single",reason="single_cheaper"} 1.0' in text
    full_blocks = len(tokenizer.encode(PROMPT)) // cluster.BLOCK_SIZE
    first_blocks = len(tokenizer.encode(f"first {PROMPT}")) // cluster.BLOCK_SIZE
    assert f"tandem_router_kv_pulled_tokens_total {float(cluster.BLOCK_SIZE * (full_blocks + first_blocks))}" in text
