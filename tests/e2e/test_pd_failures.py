"""Failures in the middle of a P/D hand-off, with real processes killed by SIGKILL.

The decode worker starts each transfer 1.5 s late (injected delay), which opens a window
while the prefill worker holds a lease for it. Each case must end in an explicit outcome
within a bound, with no lease held and every KV pool at its baseline afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import disaggregating
from tests.e2e.test_disaggregated import as_router_text, reference
from tests.stack_fixtures import StackObserver, observing
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

PREFILL = WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL, extra_args=("--kv-lease-ttl", "3"))
DECODE = WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=("--kv-fault-delay", "1.5"))


@pytest.fixture(scope="module")
def fault_stack(nats_server: EmbeddedNats, tiny_model_dir: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from disaggregating(nats_server, tiny_model_dir, tmp_path_factory.mktemp("pd-failures"), (PREFILL, DECODE))


@pytest.fixture
async def observer(fault_stack: LocalStack) -> AsyncIterator[StackObserver]:
    async with observing(fault_stack, (), "e2e-observer") as watcher:
        yield watcher


def restart(stack: LocalStack, spec: WorkerSpec) -> None:
    stack.launcher.processes.pop(spec.worker_id, None)
    stack.start_worker(spec)
    stack.wait_worker_ready(spec.worker_id)


async def test_decode_killed_while_holding_a_lease(fault_stack: LocalStack, observer: StackObserver,
                                                   tiny_model_dir: str, openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(fault_stack.router_url, timeout=30)
    prompt = [3 + (i * 13) % 500 for i in range(200)]
    request = asyncio.create_task(client.completions.create(model=tokenizer.model_name, prompt=prompt,
                                                            max_tokens=8, temperature=0))
    await wait_for(lambda: observer.leases("p1") > 0, 10,
                   lambda: f"the prefill worker to hold a lease: {observer.loads.latest}")
    fault_stack.worker("d1").popen.send_signal(signal.SIGKILL)  # mid-pull: the transfer is delayed
    killed = time.monotonic()
    with pytest.raises(openai.APIError):
        await request  # an explicit error, not a hang and not a truncated answer
    assert time.monotonic() - killed < fault_stack.config.ttl_s + 3
    waited = await wait_for(lambda: observer.leases("p1") == 0, 5,
                            lambda: f"the lease to be released: {observer.loads.latest}")
    await observer.loads.wait_idle(["p1"])
    print(f"\nlease released {waited:.2f}s after the request failed")
    restart(fault_stack, DECODE)


async def test_prefill_killed_before_the_pull_reads(fault_stack: LocalStack, observer: StackObserver,
                                                    tiny_model_dir: str, openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(fault_stack.router_url, timeout=30)
    prompt = [3 + (i * 19) % 500 for i in range(200)]
    [expected] = await reference(tokenizer, [prompt], 8)
    await wait_for(lambda: "d1" in observer.loads.latest, 10, "the decode worker")
    request = asyncio.create_task(client.completions.create(model=tokenizer.model_name, prompt=prompt,
                                                            max_tokens=8, temperature=0))
    await wait_for(lambda: observer.leases("p1") > 0, 10,
                   lambda: f"the prefill worker to hold a lease: {observer.loads.latest}")
    fault_stack.worker("p1").popen.send_signal(signal.SIGKILL)  # the decode worker's read comes after
    reply = await asyncio.wait_for(request, 30)
    # the blocks never arrived, so the decode worker computed them: the answer is still right
    assert reply.choices[0].text == as_router_text(tokenizer, prompt, expected)
    await wait_for(lambda: any(r.request_id for r in observer.records), 5, "the transfer record")
    record = observer.records[-1]
    assert record.outcome == "failed" and record.blocks_ok == 0
    assert record.recomputed_tokens == (len(prompt) // 16) * 16
    await observer.loads.wait_idle(["d1"])
    assert observer.leases("d1") == 0
    restart(fault_stack, PREFILL)
