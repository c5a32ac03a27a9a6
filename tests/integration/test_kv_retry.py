"""Retry before recompute on the sim's data plane (real sim engines, real NATS, the real
holder and puller, fault injection on the reader's transport): a block that fails once is
read again and nothing is computed; a block that fails for good is computed as before.
Either way the answers are the fault-free ones, and the worker's counters (data plane,
load snapshot) say what happened."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.bus import Bus
from shared.codec import Codec
from shared.config import BusConfig, KvFaultConfig, KvRetryConfig
from shared.schemas import TransferRecord
from shared.schemas.load import LoadSnapshot
from tests.integration.test_kv_handoff import BLOCK, TRANSPORTS, Cluster
from tests.waiting import wait_for

TRANSIENT = {"failed": KvFaultConfig(fail_fraction=0.3, fail_times=1, seed=1),
             "corrupted": KvFaultConfig(corrupt_fraction=0.3, fail_times=1, seed=2),
             "cut": KvFaultConfig(cut_after_blocks=2, fail_times=1)}


@pytest.fixture(params=TRANSPORTS)
async def cluster(bus: Bus, bus_config: BusConfig, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    nodes = Cluster(bus, bus_config, request.param)
    records: Codec[TransferRecord] = Codec(TransferRecord)
    loads: Codec[LoadSnapshot] = Codec(LoadSnapshot)
    nodes.loads = {}  # type: ignore[attr-defined]

    async def on_record(msg) -> None:
        nodes.records.append(records.decode(msg.data))

    async def on_load(msg) -> None:
        snapshot = loads.decode(msg.data)
        nodes.loads[snapshot.worker_id] = snapshot  # type: ignore[attr-defined]

    await bus.client.subscribe(bus_config.subjects.kv_transfers_all, cb=on_record)
    await bus.client.subscribe(bus_config.subjects.load("decode"), cb=on_load)
    yield nodes
    for worker in nodes.workers.values():
        await worker.stop()


async def run_prompts(cluster: Cluster, **decode_kv) -> int:
    """Every prompt on a single worker, then disaggregated (the decode worker as configured):
    the same answers. Returns the tokens the decode worker recomputed."""
    await cluster.add("single")
    await cluster.add("prefill")
    await cluster.add("decode", **decode_kv)
    recomputed = sum(done.recomputed_tokens for done in await cluster.disaggregated_prompts(8))
    await cluster.assert_clean()
    return recomputed


async def assert_counters(cluster: Cluster, *, retried: int, recovered: int, recomputed: int) -> None:
    kv = cluster.workers["decode"].kv
    pulls = [record for record in cluster.records if record.kind == "pull"]
    assert sum(record.blocks_retried for record in pulls) == retried == kv.totals.retried_blocks
    assert sum(record.blocks_recovered for record in pulls) == recovered == kv.totals.recovered_blocks
    assert sum(record.recomputed_tokens for record in pulls) == recomputed * BLOCK == kv.totals.recomputed_tokens
    assert kv.totals.recomputed_blocks == recomputed

    def snapshot_caught_up() -> bool:
        load = cluster.loads.get("decode")  # type: ignore[attr-defined]
        return load is not None and (load.kv_blocks_retried_total, load.kv_blocks_recovered_total,
                                     load.kv_blocks_recomputed_total) == (retried, recovered, recomputed)

    await wait_for(snapshot_caught_up, 5.0, "the load snapshot carries the retry counters")


@pytest.mark.parametrize("fault", list(TRANSIENT.values()), ids=list(TRANSIENT))
async def test_transient_failures_are_retried_and_nothing_is_recomputed(cluster: Cluster, fault: KvFaultConfig) -> None:
    assert await run_prompts(cluster, faults=fault) == 0
    retried = cluster.workers["decode"].kv.totals.retried_blocks
    assert retried > 0, "the injection should have failed some blocks"
    await assert_counters(cluster, retried=retried, recovered=retried, recomputed=0)
    assert all(record.outcome == "done" for record in cluster.records if record.kind == "pull")


async def test_permanent_failures_are_retried_then_recomputed(cluster: Cluster) -> None:
    recomputed = await run_prompts(cluster, faults=KvFaultConfig(fail_fraction=0.3, seed=1))
    assert recomputed > 0
    await assert_counters(cluster, retried=recomputed // BLOCK, recovered=0, recomputed=recomputed // BLOCK)


@pytest.mark.parametrize("retry", [KvRetryConfig(attempts=0), KvRetryConfig(deadline_ms=0)],
                         ids=["no-attempts", "no-time"])
async def test_without_retry_transient_failures_are_recomputed(cluster: Cluster, retry: KvRetryConfig) -> None:
    recomputed = await run_prompts(cluster, faults=TRANSIENT["failed"], retry=retry)
    assert recomputed > 0
    await assert_counters(cluster, retried=0, recovered=0, recomputed=recomputed // BLOCK)
