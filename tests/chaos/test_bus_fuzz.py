"""Bus fuzzing: hostile messages on every subject family the services subscribe to, against
a real router, two real sim workers, the metrics collector and the orchestrator on a real
nats-server.

Each family gets hypothesis-drawn garbage (random bytes, random msgpack values, truncated
real messages) and the known troublemakers: nesting bombs (~150 KB of nested maps or
arrays), wrong shapes (a real message of another stream), a future schema version. The
load and KV event streams also get forged snapshots and batches with far-future sequence
numbers and timestamps. Then:
- every malformed message is counted (router, workers, collector, orchestrator: exact counts);
- every request that expects a reply gets exactly one explicit refusal (generate: a `Failed`
  frame; lease: a `LeaseRefused`);
- no forged stream freezes a view: the router keeps serving (no 429 from a forged load);
- nothing logs a traceback or "Task exception was never retrieved"; all services alive.
"""

from __future__ import annotations

import gc
import logging
import time

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

from services.metrics.config import MetricsConfig
from services.metrics.service import MetricsService
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.service import OrchestratorService
from shared.bus import Bus, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig
from shared.schemas import GenerateRequest, KvEventBatch, LoadSnapshot, SamplingParams
from shared.schemas.generate import Failed, ResponseFrame
from shared.schemas.transfer import LeaseRefused, LeaseReply, LeaseRequest
from tests.integration.router_cluster import DEADLINE_S, MODEL_DIR_NAME, Router, wait_for_workers
from tests.waiting import wait_for

GENERATED_PER_FAMILY = 40
FAR_FUTURE_SEQ = 2**62

_frames: Codec[ResponseFrame] = Codec(ResponseFrame)
_lease_replies: Codec[LeaseReply] = Codec(LeaseReply)


def nesting_bombs() -> list[bytes]:
    return [b"\x81\xa1a" * 50_000 + b"\xc0",  # 150 KB of {"a": {"a": ...}}
            b"\x91" * 150_000 + b"\xc0",  # [[[...]]]
            b"\x82\xa1b\x01\xa1a" * 30_000 + b"\xc0"]


def load(worker_id: str, seq: int, ts: float, running: int = 0) -> LoadSnapshot:
    return LoadSnapshot(worker_id=worker_id, seq=seq, ts=ts, running=running, waiting=0, kv_total_blocks=512,
                        kv_used_blocks=0, kv_cached_blocks=0, prompt_tokens_total=0, cached_tokens_total=0,
                        generated_tokens_total=0, pending_prefill_tokens=0)


def real_messages() -> list[bytes]:
    """One real message of several streams: each is a wrong shape on every other stream."""
    request = GenerateRequest(request_id="fuzz", model=MODEL_DIR_NAME, token_ids=[5, 6, 7],
                              sampling=SamplingParams(max_tokens=1))
    lease = LeaseRequest(requester_worker_id="fuzz", compat_hash="x", block_hashes=[1], ttl_s=1.0)
    return [encode(request), encode(lease), encode(load("w1", 1, 0.0)),
            encode(KvEventBatch(worker_id="w1", seq=1, ts=0.0, events=[]))]


def future_version(message: msgspec.Struct) -> bytes:
    return encode(msgspec.structs.replace(message, v=99))


def generated_payloads(count: int) -> list[bytes]:
    payloads: list[bytes] = []
    values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                                    st.text(max_size=20), st.binary(max_size=20)),
                          lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                  st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=10)
    strategy = st.one_of(st.binary(max_size=80), values.map(msgspec.msgpack.encode),
                         st.builds(lambda message, cut: message[:cut], st.sampled_from(real_messages()),
                                   st.integers(0, 40)))

    @settings(max_examples=count, database=None, derandomize=True, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(payload: bytes) -> None:
        payloads.append(payload)

    collect()
    return payloads


def hostile_payloads(own_kind: int) -> list[bytes]:
    """Garbage for one subject family; `own_kind` is the index in `real_messages()` of the one
    message that is valid there (left out: a valid message is no garbage)."""
    shapes = [message for index, message in enumerate(real_messages()) if index != own_kind]
    return [*nesting_bombs(), *shapes, *generated_payloads(GENERATED_PER_FAMILY)]


def router_malformed(metrics_text: str) -> int:
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics_text.splitlines()
               if line.startswith("tandem_router_malformed_messages_total{"))


class Replies:
    """Every reply that arrives on one inbox prefix, by request index."""

    def __init__(self) -> None:
        self.by_index: dict[int, list[bytes]] = {}

    async def on_reply(self, msg: Msg) -> None:
        self.by_index.setdefault(int(msg.subject.rsplit(".", 1)[1]), []).append(msg.data)


@pytest.mark.timeout(120)
async def test_hostile_bus_messages_are_counted_refused_and_harmless(
        router: Router, start_worker, bus: Bus, bus_config: BusConfig, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    subjects = bus_config.subjects
    membership = MembershipConfig(heartbeat_interval_s=30.0, ttl_s=90.0)  # as the test workers'
    collector_bus = await connect(bus_config.nats_url, "fuzz-metrics")
    collector = MetricsService(MetricsConfig(port=0, bus=bus_config, membership=membership), collector_bus)
    orchestrator_bus = await connect(bus_config.nats_url, "fuzz-orchestrator")
    orchestrator = OrchestratorService(OrchestratorConfig(bus=bus_config, membership=membership), orchestrator_bus)
    await collector.start()
    await orchestrator.start()
    try:
        workers = [await start_worker("w1"), await start_worker("w2")]
        await wait_for_workers(router, 2)
        client = bus.client
        base_router = router_malformed((await router.http.get("/metrics")).text)

        # request/reply families: generate and lease, each hostile message with its own reply inbox
        generate_garbage = hostile_payloads(own_kind=0)
        lease_garbage = hostile_payloads(own_kind=1) + [future_version(LeaseRequest(
            requester_worker_id="fuzz", compat_hash="x", block_hashes=[1], ttl_s=1.0))]
        generate_garbage.append(future_version(GenerateRequest(request_id="f", model="m", token_ids=[1])))
        lease_wrong_values = [encode(LeaseRequest(requester_worker_id="fuzz", compat_hash="x", block_hashes=[1],
                                                  ttl_s=ttl)) for ttl in (float("nan"), -1.0, 1e300)]
        generate_replies, lease_replies = Replies(), Replies()
        await client.subscribe("fuzz-generate.*", cb=generate_replies.on_reply)
        await client.subscribe("fuzz-lease.*", cb=lease_replies.on_reply)
        await client.flush()
        target = workers[0].worker_id
        for index, payload in enumerate(generate_garbage):
            await client.publish(subjects.generate(target), payload, reply=f"fuzz-generate.{index}")
        lease_messages = lease_garbage + lease_wrong_values
        for index, payload in enumerate(lease_messages):
            await client.publish(subjects.kv_lease(target), payload, reply=f"fuzz-lease.{index}")

        # fire-and-forget families: control, events, records, the members bucket
        control_garbage = hostile_payloads(own_kind=-1)
        load_garbage = hostile_payloads(own_kind=2) + [future_version(load("w1", 1, time.time()))]
        kv_garbage = hostile_payloads(own_kind=3)
        record_garbage = hostile_payloads(own_kind=-1)
        for payload in control_garbage:
            await client.publish(subjects.control(target, "cancel"), payload)
        for payload in load_garbage:
            await client.publish(subjects.load(target), payload)
        for payload in kv_garbage:
            await client.publish(subjects.kv_events(target), payload)
        for payload in record_garbage:
            await client.publish(subjects.request_events, payload)
            await client.publish(subjects.kv_transfers(target), payload)
        members = await bus.key_value(subjects.members_bucket)
        bucket_garbage = [*nesting_bombs(), b"\xc1", b"", encode(load("fuzz-0", 1, 0.0))]
        for index, payload in enumerate(bucket_garbage):
            await members.put(f"fuzz-{index}", payload)
        # forged far-future numbers: a snapshot claiming a huge load from the future, KV events far ahead
        now = time.time()
        for worker in workers:
            for ts in (now + 1e9, float("nan"), float("inf")):
                await client.publish(subjects.load(worker.worker_id),
                                     encode(load(worker.worker_id, FAR_FUTURE_SEQ, ts, running=10**6)))
            await client.publish(subjects.kv_events(worker.worker_id),
                                 encode(KvEventBatch(worker_id=worker.worker_id, seq=FAR_FUTURE_SEQ, ts=now + 1e9,
                                                     events=[])))
        await client.flush()

        # exactly one explicit refusal per request
        await wait_for(lambda: len(generate_replies.by_index) == len(generate_garbage), DEADLINE_S,
                       lambda: f"a reply to each of {len(generate_garbage)} generate requests "
                               f"(got {len(generate_replies.by_index)})")
        await wait_for(lambda: len(lease_replies.by_index) == len(lease_messages), DEADLINE_S,
                       lambda: f"a reply to each of {len(lease_messages)} lease messages "
                               f"(got {len(lease_replies.by_index)})")
        for replies in generate_replies.by_index.values():
            [frame] = [_frames.decode(data) for data in replies]
            assert isinstance(frame, Failed) and frame.code == "invalid_argument", frame
        for replies in lease_replies.by_index.values():
            [reply] = [_lease_replies.decode(data) for data in replies]
            assert isinstance(reply, LeaseRefused) and reply.code == "invalid_argument", reply

        # every malformed message counted, by every service that subscribes to its subject
        per_worker = len(generate_garbage) + len(control_garbage)
        await wait_for(lambda: workers[0].service.malformed.total == per_worker, DEADLINE_S,
                       lambda: f"{per_worker} malformed at w1 (counted {workers[0].service.malformed.by_subject})")
        implausible_loads = 3 * len(workers)  # the far-future, NaN and infinite timestamps
        expected_router = len(load_garbage) + len(kv_garbage) + len(bucket_garbage) + implausible_loads

        async def router_counted() -> bool:
            return router_malformed((await router.http.get("/metrics")).text) - base_router == expected_router

        await wait_for(router_counted, DEADLINE_S, f"{expected_router} malformed counted by the router")
        expected_collector = {"load": len(load_garbage) + implausible_loads, "kv_events": len(kv_garbage),
                              "requests": len(record_garbage), "kv_transfers": len(record_garbage),
                              "members": len(bucket_garbage)}
        await wait_for(lambda: {stream: collector.malformed[stream].total for stream in expected_collector}
                       == expected_collector, DEADLINE_S,
                       lambda: f"the collector's counts {({s: c.total for s, c in collector.malformed.items()})}, "
                               f"expected {expected_collector}")
        await wait_for(lambda: orchestrator.malformed.total == len(bucket_garbage), DEADLINE_S,
                       "the orchestrator to count the bucket's garbage")

        # no view frozen, everyone alive and serving
        for _ in range(5):
            completion = await router.client.completions.create(model=MODEL_DIR_NAME, prompt="still serving?",
                                                                max_tokens=2)
            assert completion.choices[0].finish_reason == "length"
        health = (await router.http.get("/health")).json()
        assert (health["status"], health["worker_count"]) == ("ok", 2)
        assert set(orchestrator.table.members) == {"w1", "w2"}  # the garbage is no member, nobody removed
        assert all(worker.service is not None and not worker.service.stopped.is_set() for worker in workers)
        gc.collect()  # an unretrieved task exception is logged when the task is collected
        noisy = [record for record in caplog.records
                 if record.exc_info or "never retrieved" in record.getMessage() or "Traceback" in record.getMessage()]
        assert not noisy, [f"{record.name}: {record.getMessage()}" for record in noisy]
    finally:
        await orchestrator.stop()
        await collector.stop()
        await orchestrator_bus.close()
        await collector_bus.close()
