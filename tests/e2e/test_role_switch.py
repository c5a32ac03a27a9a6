"""A live role switch under load: a prefill worker becomes a decode worker while streaming
clients keep the stack busy. No request fails or comes back short, the router sends the
worker decode traffic as soon as the switch is announced, and the prompt the worker cached
as a prefill worker is still a cache hit there afterwards (engine and cache kept).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole, WorkerStatus
from shared.schemas.orchestrator import CordonWorker, ListWorkers, SetWorkerRole, UncordonWorker
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import disaggregating
from tests.e2e.control_plane_helpers import StreamingLoad, command, complete, timed_command
from tests.stack_fixtures import request_records
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

PREFILL = WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL)
DECODE = WorkerSpec(worker_id="d1", role=WorkerRole.DECODE)


@pytest.fixture
def pd_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[LocalStack]:
    yield from disaggregating(nats_server, tiny_model_dir, tmp_path_factory.mktemp("role-switch"), (PREFILL, DECODE))


async def test_prefill_worker_switches_to_decode_under_load(pd_stack: LocalStack, tiny_model_dir: str,
                                                            openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url, timeout=30)
    async with request_records(pd_stack, "role-switch-test") as records:
        # A prompt p1 computes (and caches) as the prefill worker of a disaggregated request.
        cached_prompt = [5 + (i * 11) % 480 for i in range(160)]
        await client.completions.create(model=tokenizer.model_name, prompt=cached_prompt, max_tokens=4, temperature=0)
        await wait_for(lambda: any(r.flow == "disaggregated" for r in records), 10, "the warm-up's record")

        load = StreamingLoad(client, tokenizer.model_name)
        load.start()
        await wait_for(load.wait_answers(8), 20, "answers before the switch")

        outcome, switched_s = await timed_command(pd_stack, SetWorkerRole(worker_id="p1", role=WorkerRole.DECODE))
        # Announced at once, not at the next heartbeat (generous bound for a loaded machine).
        assert switched_s < 1.0, switched_s
        [summary] = outcome.workers
        assert summary.registration.role is WorkerRole.DECODE and summary.registration.generation == 1
        switched_at = len(records)
        # Only p1 may decode now: the router sends everything to it, single-worker flows.
        assert (await command(pd_stack, CordonWorker(worker_id="d1"))).ok
        cordoned_at = len(records)

        first_decode = await wait_for(lambda: any(r.worker_id == "p1" for r in records[switched_at:]), 10,
                                      lambda: f"p1 serving after its switch: {records[switched_at:]}")
        answered = len(load.answers)
        await wait_for(load.wait_answers(answered + 8), 20, "answers after the switch")

        # The prompt p1 cached before the switch is a cache hit there now.
        reply = await client.completions.create(model=tokenizer.model_name, prompt=cached_prompt + [7, 8, 9],
                                                max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        answers = await load.stop()

        after_cordon = records[cordoned_at:]
        assert sum(r.worker_id == "p1" for r in after_cordon) >= 8, [r.worker_id for r in after_cordon]
        [hit] = [r for r in after_cordon if r.prompt_tokens == len(cached_prompt) + 3]
        assert hit.worker_id == "p1" and hit.outcome == "ok"
        assert hit.cached_tokens >= (len(cached_prompt) // 16) * 16, hit

        broken = complete(answers, load.max_tokens)
        assert not broken, f"{len(broken)} of {len(answers)} answers failed or were short: {broken[:3]}"
        assert all(r.outcome == "ok" for r in records), [r for r in records if r.outcome != "ok"]
        print(f"\nswitch acknowledged in {switched_s * 1000:.0f} ms; p1 served its first request as a decode "
              f"worker {first_decode * 1000:.0f} ms after; {len(answers)} streamed answers, none failed; "
              f"cached prefix after the switch: {hit.cached_tokens} tokens")

        listing = await command(pd_stack, ListWorkers())
        statuses = {s.registration.worker_id: (s.registration.role, s.registration.status) for s in listing.workers}
        assert statuses == {"p1": (WorkerRole.DECODE, WorkerStatus.ACTIVE), "d1": (WorkerRole.DECODE, WorkerStatus.CORDONED)}
        assert (await command(pd_stack, UncordonWorker(worker_id="d1"))).ok
        same = await command(pd_stack, SetWorkerRole(worker_id="p1", role=WorkerRole.DECODE))
        assert same.outcome == "refused" and "already" in same.reason
