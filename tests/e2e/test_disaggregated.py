"""Prefill/decode disaggregation through the whole stack, driven by the openai client.

Two clusters: 1P1D whose decode worker loses 30% of the blocks it pulls (injected), and
2P2D without faults. In both, every answer equals single-worker output (a reference sim
engine fed the same tokens), and afterwards no lease is held and every pool is at its
baseline. The 1P1D cluster's metrics show that exactly the failed blocks were recomputed.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from services.router.flows.detokenizer import IncrementalDetokenizer
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.config import WorkerConfig
from shared.nats_server import EmbeddedNats
from shared.schemas import SamplingParams, WorkerRole
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import disaggregating
from tests.stack_fixtures import observing, records_arrived, request_records
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

BLOCK = 16  # the workers' default block size
FAULTS = ("--kv-fault-fail-fraction", "0.3", "--kv-fault-seed", "5")

CLUSTERS = {
    "1p1d-faults": (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL),
                    WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=FAULTS)),
    "2p2d": (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL), WorkerSpec(worker_id="p2", role=WorkerRole.PREFILL),
             WorkerSpec(worker_id="d1", role=WorkerRole.DECODE), WorkerSpec(worker_id="d2", role=WorkerRole.DECODE)),
}


@pytest.fixture(scope="module", params=list(CLUSTERS))
def pd_stack(request: pytest.FixtureRequest, nats_server: EmbeddedNats, tiny_model_dir: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from disaggregating(nats_server, tiny_model_dir, tmp_path_factory.mktemp(request.param),
                              CLUSTERS[request.param])


def prompts(vocab_size: int) -> list[list[int]]:
    """>= 50 prompts: shorter than a block, exact multiples, one off, long."""
    lengths = [1, 3, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 80, 96, 100, 127, 128, 129, 150, 200, 256, 300, 400, 511]
    return [[3 + (seed * 131 + i * (17 + seed)) % (vocab_size - 3) for i in range(length)]
            for seed, length in enumerate(lengths * 2, start=1)]


async def reference(tokenizer: Tokenizer, prompt_ids: list[list[int]], max_tokens: int,
                    adapter: str = "") -> list[list[int]]:
    """Single-worker output: a sim engine like the workers', serving `adapter` ("": the base
    model), fed the same tokens."""
    engine = SimEngine(WorkerConfig(worker_id="reference", kv_blocks=2048), SimEngineConfig(speedup=1000),
                       model_name=tokenizer.model_name, vocab_size=tokenizer.vocab_size)
    await engine.start()
    try:
        outputs = []
        for index, prompt in enumerate(prompt_ids):
            tokens: list[int] = []
            async for output in engine.generate(f"ref-{index}", prompt, SamplingParams(max_tokens=max_tokens),
                                                adapter=adapter):
                tokens += output.token_ids
            outputs.append(tokens)
        return outputs
    finally:
        await engine.stop()


def as_router_text(tokenizer: Tokenizer, prompt: list[int], completion: list[int]) -> str:
    """The completion's text as the router renders it: decoded in the prompt's context."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return detokenizer.push(completion) + detokenizer.finish()


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{key}="{value}"' in line for key, value in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def metrics_when(collector: Callable[[], Awaitable[str]], condition: Callable[[str], bool],
                       what: Callable[[str], str], timeout_s: float = 10.0) -> str:
    """The collector's metrics text once `condition` holds for it (polled every 0.1 s);
    at the deadline, fails with `what` said of the latest text."""
    latest = [""]

    async def met() -> bool:
        latest[0] = await collector()
        return condition(latest[0])

    await wait_for(met, timeout_s, lambda: what(latest[0]), interval_s=0.1)
    return latest[0]


async def no_leases_and_empty_pools(collector: Callable[[], Awaitable[str]]) -> str:
    """Wait (10 s at most) until the collector reports no lease held and no KV used on any
    worker; returns that metrics text."""
    def counts(text: str) -> tuple[float, float]:
        return metric(text, "tandem_worker_kv_active_leases"), metric(text, "tandem_worker_kv_usage_ratio")

    return await metrics_when(collector, lambda text: counts(text) == (0, 0),
                              lambda text: "no lease and no KV used (leases %s, KV usage %s)" % counts(text))


async def test_disaggregated_output_equals_single_worker(pd_stack: LocalStack, tiny_model_dir: str,
                                                        openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url)
    prompt_ids = prompts(tokenizer.vocab_size)
    assert len(prompt_ids) >= 50
    expected = await reference(tokenizer, prompt_ids, 12)

    async def ask(prompt: list[int]) -> str:
        reply = await client.completions.create(model=tokenizer.model_name, prompt=prompt, max_tokens=12,
                                                temperature=0)
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 12
        return reply.choices[0].text

    semaphore = asyncio.Semaphore(8)

    async def bounded(prompt: list[int]) -> str:
        async with semaphore:
            return await ask(prompt)

    texts = await asyncio.gather(*(bounded(prompt) for prompt in prompt_ids))
    mismatched = [(len(p), t, as_router_text(tokenizer, p, e)) for p, t, e in zip(prompt_ids, texts, expected)
                  if t != as_router_text(tokenizer, p, e)]
    assert not mismatched, f"{len(mismatched)} answers differ from single-worker output: {mismatched[:3]}"

    # streamed, too
    stream = await client.completions.create(model=tokenizer.model_name, prompt=prompt_ids[-1], max_tokens=12,
                                             temperature=0, stream=True)
    streamed = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
    assert streamed == as_router_text(tokenizer, prompt_ids[-1], expected[-1])

    async with httpx.AsyncClient() as http:
        router_metrics = (await http.get(f"{pd_stack.router_url}/metrics")).text
        assert metric(router_metrics, "tandem_router_route_decisions_total", flow="disaggregated") >= len(prompt_ids)

        # the collector: tokens pulled vs recomputed, and what the decode workers report
        async def collector() -> str:
            return (await http.get(f"{pd_stack.metrics_url}/metrics")).text

        with_blocks = sum(1 for p in prompt_ids if len(p) >= BLOCK) + 1  # + the streamed one
        text = await metrics_when(
            collector, lambda text: metric(text, "tandem_kv_transfers_total", kind="pull") >= with_blocks,
            lambda text: f"{with_blocks} pulls counted ({metric(text, 'tandem_kv_transfers_total', kind='pull')})")
        pulls = metric(text, "tandem_kv_transfers_total", kind="pull")
        assert pulls == with_blocks, "one pull per disaggregated request with a full block"
        pulled = metric(text, "tandem_kv_transfer_tokens_total", kind="pull", source="pulled")
        recomputed = metric(text, "tandem_kv_transfer_tokens_total", kind="pull", source="recomputed")
        asked = metric(text, "tandem_kv_transfer_blocks_total", kind="pull")
        assert pulled > 0 and pulled + recomputed == asked * BLOCK
        failed_blocks = metric(text, "tandem_kv_transfer_blocks_total", kind="pull", result="failed")
        assert recomputed == failed_blocks * BLOCK
        worker_recomputed = metric(text, "tandem_worker_kv_recomputed_tokens_total")
        if "d1" in pd_stack.processes and any("--kv-fault-fail-fraction" in a for a in pd_stack.worker("d1").argv):
            assert failed_blocks > 0, "30% injected failures should fail some blocks"
            assert worker_recomputed == recomputed
        else:
            assert failed_blocks == 0 and recomputed == 0

        # no lease left, every pool back to baseline
        text = await no_leases_and_empty_pools(collector)
        assert re.search(r"tandem_worker_kv_active_leases\{", text)


async def test_multi_turn_prefill_pulls_the_conversation(pd_stack: LocalStack, tiny_model_dir: str,
                                                         openai_client) -> None:
    """Turn 2's prefill worker pulls turn 1 (prompt + answer) from the decode worker that
    generated it, and computes only the new turn's tokens."""
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url)
    turn1 = [3 + (i * 29 + 11) % (tokenizer.vocab_size - 3) for i in range(150)]
    [answer1] = await reference(tokenizer, [turn1], 40)
    reply1 = await client.completions.create(model=tokenizer.model_name, prompt=turn1, max_tokens=40, temperature=0)
    assert reply1.choices[0].text == as_router_text(tokenizer, turn1, answer1)
    turn2 = turn1 + answer1 + [3 + (i * 7) % 200 for i in range(21)]
    [answer2] = await reference(tokenizer, [turn2], 8)
    held = len(turn1 + answer1[:-1]) // BLOCK  # blocks the decode worker holds (the last token has no KV)

    prefills = [spec.worker_id for spec in pd_stack.config.workers if spec.role is WorkerRole.PREFILL]
    async with httpx.AsyncClient() as http, observing(pd_stack, tuple(prefills)) as observer:
        async def collector() -> str:
            return (await http.get(f"{pd_stack.metrics_url}/metrics")).text

        def by_prefill(text: str) -> float:
            return metric(text, "tandem_worker_computed_prompt_tokens_total", role="prefill")

        async def settled() -> float:
            """The prompt tokens the prefill workers computed, everything before now counted:
            idle workers' reports taken after now, and the collector showing the same."""
            await observer.loads.fresh_reports(prefills)
            await observer.loads.wait_idle(prefills)
            total = sum(observer.counter(w, "computed_prompt_tokens_total") for w in prefills)
            await metrics_when(collector, lambda text: by_prefill(text) == total,
                               lambda text: f"the collector to count {total} prefill tokens ({by_prefill(text)})")
            return total

        before = await settled()
        reply2 = await client.completions.create(model=tokenizer.model_name, prompt=turn2, max_tokens=8,
                                                 temperature=0)
        assert reply2.choices[0].text == as_router_text(tokenizer, turn2, answer2)
        computed = await settled() - before
        router_metrics = (await http.get(f"{pd_stack.router_url}/metrics")).text
    assert metric(router_metrics, "tandem_router_prefix_pulls_total") >= 1
    assert computed == len(turn2) - held * BLOCK, (
        f"turn 2's prefill computed {computed} tokens; only the {len(turn2) - held * BLOCK} new ones were needed")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


async def test_idle_workers_do_not_spin(pd_stack: LocalStack) -> None:
    """Each worker holds a NIXL agent with a registered pool: idle, it must stay near 0% CPU."""
    workers = {name: process.pid for name, process in pd_stack.processes.items() if name[0] in "pd"}
    async with httpx.AsyncClient() as http:
        async def collector() -> str:
            return (await http.get(f"{pd_stack.metrics_url}/metrics")).text

        await no_leases_and_empty_pools(collector)  # the last test's requests are over
    before = {name: cpu_seconds(pid) for name, pid in workers.items()}
    started = time.monotonic()
    await asyncio.sleep(3.0)  # the measurement window: CPU used while idle, not a wait for anything
    elapsed = time.monotonic() - started
    usage = {name: 100 * (cpu_seconds(pid) - before[name]) / elapsed for name, pid in workers.items()}
    print(f"\nidle CPU % of a core: {usage}")
    assert all(percent < 5.0 for percent in usage.values()), usage


async def test_a_cache_salt_shares_kv_only_with_requests_of_the_same_salt(pd_stack: LocalStack, tiny_model_dir: str,
                                                                         openai_client) -> None:
    """vLLM's cache_salt, split on the sim: one prompt with salt a, then b, then a again, each
    answering as a single engine does; b finds none of a's blocks, a again finds them all
    (cached where it is computed, or pulled); the router's index tells the salts apart too (a
    fourth salt with cache_hit_threshold is answered "cache_threshold")."""
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url)
    prompt = [3 + (i * 37 + 5) % (tokenizer.vocab_size - 3) for i in range(150)]
    [expected] = await reference(tokenizer, [prompt], 8)

    async def ask(salt: str, **fields) -> str:
        reply = await client.completions.create(model=tokenizer.model_name, prompt=prompt, max_tokens=8,
                                                temperature=0, extra_body={"cache_salt": salt, **fields})
        return reply.choices[0].finish_reason if fields else reply.choices[0].text

    async with request_records(pd_stack, "cache-salt-test") as records:
        texts = [await ask(salt) for salt in ("a", "b", "a")]
        refused = await ask("c", cache_hit_threshold=0.3)
        await records_arrived(records, 4)
    assert texts == [as_router_text(tokenizer, prompt, expected)] * 3
    assert refused == "cache_threshold"
    whole_blocks = len(prompt) // BLOCK * BLOCK
    assert [record.cached_tokens for record in records[:3]] == [0, 0, whole_blocks], records[:3]
