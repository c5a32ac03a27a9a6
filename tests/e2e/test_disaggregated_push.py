"""Prefill/decode disaggregation in push mode (`--pd-transfer push`) through the whole stack.

Two 1P1D sim clusters: one clean, one whose prefill worker fails 30% of the blocks it
writes (injected: the writer's transport breaks them, the decode worker's verification
catches them and it recomputes exactly those). In both, every answer equals single-worker
output, the decode worker's transfer records show pushes (none pulled), and afterwards no
lease is held and every pool is back at its baseline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.test_disaggregated import (
    BLOCK,
    as_router_text,
    metric,
    metrics_when,
    no_leases_and_empty_pools,
    prompts,
    reference,
)
from tests.stack_fixtures import LoadWatcher, make_stack, running

pytestmark = pytest.mark.e2e

PUSH = (*ALWAYS_DISAGGREGATE, "--pd-transfer", "push")
FAULTS = ("--kv-fault-fail-fraction", "0.3", "--kv-fault-seed", "5")  # on the writer: push writes break

CLUSTERS = {
    "1p1d": (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL), WorkerSpec(worker_id="d1", role=WorkerRole.DECODE)),
    "1p1d-faults": (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL, extra_args=FAULTS),
                    WorkerSpec(worker_id="d1", role=WorkerRole.DECODE)),
}
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(CLUSTERS))
def push_stack(request: pytest.FixtureRequest, nats_server: EmbeddedNats, tiny_model_dir: str,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp(f"push-{request.param}"),
                            workers=0, router_args=PUSH, specs=CLUSTERS[request.param])) as stack:
        yield stack


@pytest.fixture
async def push_loads(push_stack: LocalStack) -> AsyncIterator[LoadWatcher]:
    bus: Bus = await connect(push_stack.nats_url, "e2e-push-test")
    watcher = LoadWatcher()
    await watcher.start(bus, Subjects(push_stack.config.namespace).load_all)
    try:
        yield watcher
    finally:
        await bus.close()


async def test_pushed_output_equals_single_worker(push_stack: LocalStack, push_loads: LoadWatcher,
                                                 tiny_model_dir: str, openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(push_stack.router_url)
    prompt_ids = prompts(tokenizer.vocab_size)[:30]  # 1..511 tokens, exact block multiples among them
    expected = await reference(tokenizer, prompt_ids, MAX_TOKENS)
    semaphore = asyncio.Semaphore(8)

    async def ask(prompt: list[int]) -> str:
        async with semaphore:
            reply = await client.completions.create(model=tokenizer.model_name, prompt=prompt,
                                                    max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
        return reply.choices[0].text

    texts = await asyncio.gather(*(ask(prompt) for prompt in prompt_ids))
    mismatched = [(len(p), t, as_router_text(tokenizer, p, e)) for p, t, e in zip(prompt_ids, texts, expected)
                  if t != as_router_text(tokenizer, p, e)]
    assert not mismatched, f"{len(mismatched)} answers differ from single-worker output: {mismatched[:3]}"

    # streamed, too
    stream = await client.completions.create(model=tokenizer.model_name, prompt=prompt_ids[-1],
                                             max_tokens=MAX_TOKENS, temperature=0, stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert streamed == as_router_text(tokenizer, prompt_ids[-1], expected[-1])

    # one token asked for: the prefill worker alone answers (no decode part, nothing pushed)
    one = await client.completions.create(model=tokenizer.model_name, prompt=prompt_ids[5], max_tokens=1,
                                          temperature=0)
    assert one.choices[0].text == as_router_text(tokenizer, prompt_ids[5], expected[5][:1])

    async with httpx.AsyncClient() as http:
        router_metrics = (await http.get(f"{push_stack.router_url}/metrics")).text
        pushed_requests = len(prompt_ids) + 1  # + the streamed one
        assert metric(router_metrics, "tandem_router_kv_transfer_mode_total", mode="push") == pushed_requests
        assert metric(router_metrics, "tandem_router_kv_transfer_mode_total", mode="pull") == 0

        async def collector() -> str:
            return (await http.get(f"{push_stack.metrics_url}/metrics")).text

        with_blocks = sum(1 for p in prompt_ids if len(p) >= BLOCK) + 1
        text = await metrics_when(
            collector, lambda text: metric(text, "tandem_kv_transfers_total", kind="push") >= with_blocks,
            lambda text: f"push records for the {with_blocks} requests with a full block "
                         f"({metric(text, 'tandem_kv_transfers_total', kind='push')})")
        assert metric(text, "tandem_kv_transfers_total", kind="pull") == 0
        pushed = metric(text, "tandem_kv_transfer_tokens_total", kind="push", source="pulled")
        recomputed = metric(text, "tandem_kv_transfer_tokens_total", kind="push", source="recomputed")
        assert pushed > 0
        if any("--kv-fault-fail-fraction" in arg for arg in push_stack.worker("p1").argv):
            assert recomputed > 0, "30% injected write failures should fail some blocks"
        else:
            assert recomputed == 0

        # nothing left behind: no lease, no running request, every pool at its baseline
        await push_loads.wait_idle(["p1", "d1"])
        await no_leases_and_empty_pools(collector)
