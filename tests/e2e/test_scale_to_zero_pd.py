"""Scale to zero for a disaggregated model: a P/D model with no worker is served disaggregated
once the orchestrator starts its prefill and decode workers, and goes back to no worker when
idle (the whole stack as processes, the official `openai` client).

The stack has no worker at all. `pd` (another vocabulary) is a scalable model declared
`pd=DIR@1p1d`, given alike to the router and the orchestrator (`StackConfig.scalable_models`);
the orchestrator has a local launcher and `--scale-to-zero-after`, the router splits every
request it can (`--local-prefill-tokens 0`). Concurrent requests to `pd` are held, one wake
starts a prefill and a decode worker together, and every request is answered in full, each
one disaggregated: its request record says so, and the decode worker's transfer records show
it pulled each prompt's KV from the prefill worker. With no traffic, both workers are drained
and stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from launch.stack import LocalStack
from shared.bus import connect
from shared.nats_server import EmbeddedNats
from shared.schemas import TransferRecord
from shared.subjects import Subjects
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.control_plane_helpers import back_at_zero, first_token_after, launching_stack, workers_of
from tests.stack_fixtures import collect, records_arrived, request_records
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

CONCURRENT = 8
MAX_TOKENS = 6
IDLE_S = 4.0
SCALE_DOWN_BOUND_S = 10.0  # past the idle time: the scaler's look, both drains, the deregistrations
BLOCK = 16  # the workers' default block size: a prompt of whole blocks has KV to pull


@pytest.fixture(scope="module")
def pd_zero_stack(nats_server: EmbeddedNats, tiny_model_dir: str, small_model_dir: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from launching_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("scale-to-zero-pd"),
                               {"pd": f"{small_model_dir}@1p1d"}, (*ALWAYS_DISAGGREGATE, "--cold-start-wait", "60"),
                               IDLE_S)


async def test_a_pd_model_at_zero_is_served_disaggregated_once_both_workers_start_and_returns_to_zero(
        pd_zero_stack: LocalStack, openai_client) -> None:
    stack = pd_zero_stack
    client = openai_client(stack.router_url, timeout=90)
    assert await workers_of(stack, "pd") == []
    prompts = [[3 + (index * 37 + i * 11) % 1000 for i in range(2 * BLOCK + index)] for index in range(CONCURRENT)]

    async with request_records(stack, "pd-records") as records, \
            await connect(stack.nats_url, "pd-transfers") as bus:
        transfers = await collect(bus, TransferRecord, Subjects(stack.config.namespace).kv_transfers_all)
        started = time.monotonic()
        answers = await asyncio.gather(*(first_token_after(client, "pd", prompt, MAX_TOKENS, started) for prompt in prompts))
        assert [tokens for _, _, tokens in answers] == [MAX_TOKENS] * CONCURRENT, answers  # none lost
        await records_arrived(records, CONCURRENT)
        await wait_for(lambda: len(transfers) >= CONCURRENT, 5,
                       lambda: f"{CONCURRENT} transfer records ({len(transfers)} arrived)")
    answered_at = time.monotonic()
    workers = {worker_id: (pid, launched) for worker_id, pid, launched in await workers_of(stack, "pd")}
    roles = sorted(worker_id.split("-")[1] for worker_id in workers)
    assert roles == ["decode", "prefill"] and all(launched for _, launched in workers.values()), workers
    [prefill] = [worker_id for worker_id in workers if "-prefill-" in worker_id]
    [decode] = [worker_id for worker_id in workers if "-decode-" in worker_id]
    assert [(record.model, record.outcome, record.flow) for record in records] == \
        [("pd", "ok", "disaggregated")] * CONCURRENT, records
    assert all(record.worker_id == decode for record in records), records
    pulls = [t for t in transfers if t.worker_id == decode and t.peer_worker_id == prefill and t.outcome == "done"]
    assert len(pulls) >= CONCURRENT and all(t.blocks_ok >= 2 for t in pulls), transfers
    first_tokens = sorted(first for first, _, _ in answers)
    print(f"\nP/D scale from zero: {CONCURRENT} concurrent requests, all answered ({MAX_TOKENS} tokens each), "
          f"disaggregated over the started {prefill} and {decode} ({len(pulls)} KV pulls); first request to first "
          f"token {first_tokens[0]:.2f} s (last request's first token {first_tokens[-1]:.2f} s)")

    scaled_down_s, waited = await back_at_zero(stack, "pd", [pid for pid, _ in workers.values()], answered_at,
                                               IDLE_S, SCALE_DOWN_BOUND_S)
    print(f"P/D scale to zero: no worker of pd {scaled_down_s:.2f} s after the last answer "
          f"(idle time {IDLE_S:g} s; waited {waited:.2f} s)")
