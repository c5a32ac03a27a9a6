"""Draining a prefill worker while decode workers are still pulling from it.

The decode worker starts each transfer 1.5 s late (injected delay), so when the drain
begins the prefill worker holds leases its readers have not read yet. The drain must let
every pull finish (no failed transfer, nothing recomputed, every answer whole) and only
then take the worker out: deregistered, process exited.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from shared.schemas.orchestrator import DrainWorker, ListWorkers
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import disaggregating
from tests.e2e.control_plane_helpers import command, timed_command
from tests.stack_fixtures import observing
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

PREFILL = WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL)
DECODE = WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=("--kv-fault-delay", "1.5"))


@pytest.fixture
def slow_pull_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[LocalStack]:
    yield from disaggregating(nats_server, tiny_model_dir, tmp_path_factory.mktemp("drain"), (PREFILL, DECODE))


async def test_draining_prefill_worker_finishes_every_pull_then_leaves(slow_pull_stack: LocalStack,
                                                                       tiny_model_dir: str, openai_client) -> None:
    stack = slow_pull_stack
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(stack.router_url, timeout=30)
    async with observing(stack, ("p1", "d1"), "drain-observer") as observer:
        prompts = [[3 + (seed * 37 + i * 13) % 500 for i in range(128)] for seed in range(3)]
        requests = [asyncio.create_task(client.completions.create(model=tokenizer.model_name, prompt=prompt,
                                                                  max_tokens=8, temperature=0))
                    for prompt in prompts]
        await wait_for(lambda: observer.leases("p1") >= len(prompts), 10,
                       lambda: f"p1 holding a lease per request: {observer.loads.latest}")
        outcome, drained_s = await timed_command(stack, DrainWorker(worker_id="p1", deadline_s=20), timeout_s=40)
        replies = await asyncio.gather(*requests)
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8 for r in replies)

        pulls = [r for r in observer.records if r.peer_worker_id == "p1"]
        assert len(pulls) == len(prompts), observer.records
        assert all(r.outcome == "done" and r.recomputed_tokens == 0 and r.blocks_ok > 0 for r in pulls), pulls
        # It left only after its readers were done: the 1.5 s transfer delay is inside the drain.
        assert drained_s >= 1.0, drained_s
        exit_code = await asyncio.to_thread(stack.worker("p1").popen.wait, 10)
        assert exit_code == 0
        listing = await command(stack, ListWorkers())
        assert [s.registration.worker_id for s in listing.workers] == ["d1"]
        # With no prefill worker left, the decode worker serves whole requests.
        reply = await client.completions.create(model=tokenizer.model_name, prompt=prompts[0], max_tokens=4,
                                                temperature=0)
        assert reply.choices[0].finish_reason == "length"
        await observer.loads.wait_idle(["d1"])
        assert observer.leases("d1") == 0
        print(f"\ndrain of p1 with {len(prompts)} pulls in flight took {drained_s:.2f} s; every pull completed")
