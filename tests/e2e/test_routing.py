"""The router's intelligence against real sim workers: prefix affinity, decode-first with
a cache-hit threshold, and two model versions live at once (a rolling upgrade)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.nats_server import EmbeddedNats
from shared.schemas import RequestRecord, TransferRecord, WorkerRole
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.stack_fixtures import collect, make_stack, records_arrived, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def three_workers(nats_server: EmbeddedNats, tiny_model_dir: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("routing"), workers=3)) as stack:
        yield stack


async def records_of(stack: LocalStack, record_type: type, subject: str) -> tuple[list, Bus]:
    bus = await connect(stack.nats_url, "e2e-records")
    return await collect(bus, record_type, subject), bus


async def test_prefix_heavy_requests_go_to_the_worker_holding_the_prefix(three_workers: LocalStack,
                                                                         tiny_model_dir: str, openai_client) -> None:
    model = Tokenizer.from_model_dir(tiny_model_dir).model_name
    client = openai_client(three_workers.router_url, timeout=30)
    subjects = Subjects(three_workers.config.namespace)
    records, bus = await records_of(three_workers, RequestRecord, subjects.request_events)
    try:
        holders = {}
        for tenant in range(4):
            prefix = [3 + (i * (tenant + 3) * 7) % 500 for i in range(600)]
            before = len(records)
            await client.completions.create(model=model, prompt=prefix, max_tokens=2, temperature=0)
            await records_arrived(records, before + 1)
            holders[tenant] = records[-1].worker_id
        assert len(set(holders.values())) > 1, "idle workers should share the first requests"
        for tenant in range(4):
            prefix = [3 + (i * (tenant + 3) * 7) % 500 for i in range(600)]
            before = len(records)
            reply = await client.completions.create(model=model, prompt=prefix + [7, 8, 9, tenant + 10],
                                                    max_tokens=2, temperature=0)
            await records_arrived(records, before + 1)
            assert records[-1].worker_id == holders[tenant], f"tenant {tenant} left its prefix's worker"
            assert reply.usage.prompt_tokens_details.cached_tokens >= 576  # 36 of its 37 full blocks
    finally:
        await bus.close()


async def test_cache_hit_threshold_answers_decode_first(three_workers: LocalStack, tiny_model_dir: str,
                                                        openai_client) -> None:
    model = Tokenizer.from_model_dir(tiny_model_dir).model_name
    client = openai_client(three_workers.router_url, timeout=30)
    prompt = [3 + (i * 53) % 500 for i in range(320)]
    threshold = {"cache_hit_threshold": 0.5}
    cold = await client.completions.create(model=model, prompt=prompt, max_tokens=8, extra_body=threshold)
    assert cold.choices[0].finish_reason == "cache_threshold"
    assert cold.choices[0].text == "" and cold.usage.completion_tokens == 0 and cold.usage.prompt_tokens == 320
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=8, stream=True,
                                             extra_body=threshold)
    chunks = [chunk async for chunk in stream]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] [-1] == "cache_threshold"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ""
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        extra_body={"cache_hit_threshold": 1.5})

    await client.completions.create(model=model, prompt=prompt, max_tokens=8)  # now a worker holds it
    replies = []

    async def answered_warm() -> bool:  # the router learns of the cached prompt from the worker's KV events
        replies.append(await client.completions.create(model=model, prompt=prompt, max_tokens=8, extra_body=threshold))
        return replies[-1].choices[0].finish_reason != "cache_threshold"

    await wait_for(answered_warm, 5, "the router to see the prompt cached", interval_s=0.1)
    warm = replies[-1]
    assert warm.choices[0].finish_reason == "length" and warm.usage.completion_tokens == 8
    chat = await client.chat.completions.create(model=model, max_tokens=4, extra_body=threshold,
                                                messages=[{"role": "user", "content": "an unseen question " * 20}])
    assert chat.choices[0].finish_reason == "cache_threshold" and not chat.choices[0].message.content


VERSIONS = {"p1": "v1", "d1": "v1", "p2": "v2", "d2": "v2"}


@pytest.fixture(scope="module")
def two_versions(nats_server: EmbeddedNats, tiny_model_dir: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    roles = {"p": WorkerRole.PREFILL, "d": WorkerRole.DECODE}
    specs = tuple(WorkerSpec(worker_id=name, role=roles[name[0]], extra_args=("--model-version", version))
                  for name, version in VERSIONS.items())
    with running(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("upgrade"), workers=0, specs=specs,
                            router_args=ALWAYS_DISAGGREGATE)) as stack:
        yield stack


async def test_two_model_versions_live_are_never_paired(two_versions: LocalStack, tiny_model_dir: str,
                                                        openai_client) -> None:
    model = Tokenizer.from_model_dir(tiny_model_dir).model_name
    client = openai_client(two_versions.router_url, timeout=30)
    subjects = Subjects(two_versions.config.namespace)
    transfers, bus = await records_of(two_versions, TransferRecord, subjects.kv_transfers_all)
    try:
        prompts = [[3 + (i * (n + 5) * 11) % 500 for i in range(64 + 16 * n)] for n in range(20)]
        replies = await asyncio.gather(*(client.completions.create(model=model, prompt=p, max_tokens=6,
                                                                   temperature=0) for p in prompts))
        assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6 for r in replies)
        await records_arrived(transfers, 20)
        pairs = {(r.peer_worker_id, r.worker_id) for r in transfers}
        assert all(VERSIONS[prefill] == VERSIONS[decode] for prefill, decode in pairs), pairs
        assert {VERSIONS[decode] for _, decode in pairs} == {"v1", "v2"}, "both versions should serve"
    finally:
        await bus.close()
