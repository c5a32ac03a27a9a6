"""NATS users and permissions, against a real nats-server secured the way `tandem up`
secures it (`shared.nats_security`: a user per service, TLS with client certificates).

Who cannot get in: an anonymous client, a client without TLS, a wrong password (each
refused fast, with a one-line reason). What a user cannot do: a worker cannot drain or
cancel on another worker nor read another worker's requests; the router cannot ask for
KV leases nor drain; a worker cannot register another. Each refusal is shown twice: the
server reports a permissions violation to the offender, and the would-be receiver gets a
permitted message sent after the forbidden one, but never the forbidden one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from services.worker.sim.config import SimEngineConfig
from shared.bus import Bus, BusConnectError, client_ssl_context, connect
from shared.codec import Codec, encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig
from shared.frame_sender import FrameSender
from shared.nats_secrets import Credentials, CredentialsError, write_credentials
from shared.nats_security import NatsSecurity
from shared.nats_server import EmbeddedNats
from shared.request_plane import FrameQueue, ResponseInbox
from shared.schemas import Cancel, Drain, KvSnapshotRequest, WorkerStatus
from shared.schemas.transfer import LeaseAck, LeaseRefused, LeaseRelease, LeaseReply, LeaseRequest
from shared.subjects import Subjects
from tests.integration.sim_workers import start_sim_worker
from tests.integration.test_kv_handoff import start_worker, worker_config
from tests.waiting import wait_for

NAMESPACE = "secure"
SUBJECTS = Subjects(NAMESPACE)
FAIL_FAST_S = 8.0  # "a few seconds": a refusal is never an endless retry nor a long timeout


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedNats, NatsSecurity]]:
    directory = tmp_path_factory.mktemp("secure-nats")
    security = NatsSecurity.create(directory / "auth", NAMESPACE, ["w1", "w2"])
    with EmbeddedNats(str(directory / "nats"), config_file=security.server_config_file, tls=True) as server:
        yield server, security


@pytest.fixture
async def users(secured) -> AsyncIterator:
    """`as_user(name)`: a connection with that user's credentials and certificate."""
    server, security = secured
    opened: list[Bus] = []

    async def as_user(name: str) -> Bus:
        bus = await connect(security.bus_config(name, server.url, NAMESPACE), f"test-{name}")
        opened.append(bus)
        return bus

    yield as_user
    for bus in opened:
        await bus.close()


async def subscribed(bus: Bus) -> None:
    """Until the server has every subscription the client made. nats-py writes a flush's PING
    straight to the socket, ahead of subscriptions still in its buffer: the PONG of a first
    flush may come before they are in; a second PING goes out after them."""
    await bus.client.flush()
    await bus.client.flush()


class Inbox:
    """Every message a connection receives on the subjects it subscribed, in order."""

    def __init__(self) -> None:
        self.subjects: list[str] = []

    async def subscribe(self, bus: Bus, *subjects: str) -> Inbox:
        for subject in subjects:
            await bus.client.subscribe(subject, cb=self._on_message)
        await subscribed(bus)
        return self

    async def _on_message(self, msg) -> None:
        self.subjects.append(msg.subject)


def violations(caplog: pytest.LogCaptureFixture, what: str = "") -> list[str]:
    """The permissions violations NATS reported to this process's clients (about `what`)."""
    return [r.getMessage() for r in caplog.records
            if "permissions violation" in r.getMessage().lower() and what.lower() in r.getMessage().lower()]


async def assert_refused(caplog: pytest.LogCaptureFixture, what: str) -> None:
    await wait_for(lambda: violations(caplog, what), 10, f"a permissions violation for {what}")


# ---- who cannot get in --------------------------------------------------------------


async def refused(config: BusConfig) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(BusConnectError) as caught:
        await asyncio.wait_for(connect(config, "test-intruder"), FAIL_FAST_S * 2)
    elapsed = time.monotonic() - started
    assert elapsed < FAIL_FAST_S, f"refused only after {elapsed:.1f}s"
    message = str(caught.value)
    assert "\n" not in message
    return message, elapsed


async def test_an_anonymous_client_cannot_connect(secured) -> None:
    server, security = secured
    message, _ = await refused(BusConfig(nats_url=server.url))  # no TLS, no credentials
    assert "requires TLS" in message
    # TLS right, no credentials: the client certificate alone does not let it in
    operator = security.bus_config("operator", server.url, NAMESPACE)
    message, _ = await refused(BusConfig(nats_url=server.url, tls_ca_file=operator.tls_ca_file,
                                         tls_cert_file=operator.tls_cert_file, tls_key_file=operator.tls_key_file))
    assert "refused a client without credentials (authorization violation)" in message


async def test_a_forged_drain_from_an_unauthenticated_client_is_impossible(secured, users) -> None:
    """A plain nats-py client (not Tandem's `connect`): without credentials the server takes
    no message from it, with or without TLS; the worker sees only the operator's drain."""
    server, security = secured
    w1, operator = await users("worker-w1"), await users("operator")
    received = await Inbox().subscribe(w1, SUBJECTS.control_all("w1"))
    operator_files = security.bus_config("operator", server.url, NAMESPACE)
    attempts = [dict(tls=client_ssl_context(operator_files), tls_handshake_first=True),  # TLS, no user
                dict(servers=[server.url.replace("tls://", "nats://")])]  # neither
    for options in attempts:
        options = {"servers": [server.url], **options}
        with pytest.raises(Exception):
            client = await asyncio.wait_for(nats.connect(**options, allow_reconnect=False, connect_timeout=3), 10)
            await client.publish(SUBJECTS.control("w1", "drain"), encode(Drain(deadline_s=0)))  # not reached
            await client.close()
    await operator.client.publish(SUBJECTS.control("w1", "kv_snapshot"), b"marker")  # the operator may not
    await operator.client.publish(SUBJECTS.control("w1", "drain"), encode(Drain(deadline_s=0)))
    await wait_for(lambda: received.subjects, 10, "the operator's drain")
    assert received.subjects == [SUBJECTS.control("w1", "drain")]


async def test_a_wrong_password_fails_fast_with_a_clear_error(secured, tmp_path: Path) -> None:
    server, security = secured
    router = security.bus_config("router", server.url, NAMESPACE)
    wrong = write_credentials(tmp_path / "wrong.creds", Credentials(user="router", password="guessed-password"))
    message, _ = await refused(BusConfig(nats_url=server.url, creds_file=str(wrong), tls_ca_file=router.tls_ca_file,
                                         tls_cert_file=router.tls_cert_file, tls_key_file=router.tls_key_file))
    assert message == f"NATS at {server.url} refused the credentials in {wrong} (authorization violation)"
    assert "guessed-password" not in message


async def test_tls_without_a_client_certificate_is_refused(secured) -> None:
    server, security = secured
    router = security.bus_config("router", server.url, NAMESPACE)
    message, _ = await refused(BusConfig(nats_url=server.url, creds_file=router.creds_file,
                                         tls_ca_file=router.tls_ca_file))
    assert message.startswith(f"TLS with NATS at {server.url} failed:")


async def test_a_server_certificate_from_another_ca_is_refused(secured, tmp_path: Path) -> None:
    server, security = secured
    other = NatsSecurity.create(tmp_path / "other", NAMESPACE, [])
    router = security.bus_config("router", server.url, NAMESPACE)
    message, _ = await refused(BusConfig(nats_url=server.url, creds_file=router.creds_file,
                                         tls_ca_file=other.ca_file, tls_cert_file=router.tls_cert_file,
                                         tls_key_file=router.tls_key_file))
    assert f"its certificate does not verify against {other.ca_file}" in message


async def test_a_missing_credentials_file_is_named(secured, tmp_path: Path) -> None:
    server, _ = secured
    with pytest.raises(CredentialsError, match=f"NATS credentials file {tmp_path}/absent.creds does not exist"):
        await connect(BusConfig(nats_url=server.url, creds_file=str(tmp_path / "absent.creds")), "test")


# ---- what each user cannot do -------------------------------------------------------


async def test_a_worker_cannot_drain_or_cancel_another_worker(users, caplog) -> None:
    w1, w2, operator = await users("worker-w1"), await users("worker-w2"), await users("operator")
    received = await Inbox().subscribe(w2, SUBJECTS.control_all("w2"))
    await w1.client.publish(SUBJECTS.control("w2", "drain"), encode(Drain(deadline_s=0)))
    await w1.client.publish(SUBJECTS.control("w2", "cancel"), encode(Cancel(request_id="r")))
    await w1.client.publish(SUBJECTS.control("w2", "push_done"), b"after")  # allowed: the pushing writer's
    await assert_refused(caplog, f'Publish to "{SUBJECTS.control("w2", "drain")}"')
    await assert_refused(caplog, f'Publish to "{SUBJECTS.control("w2", "cancel")}"')
    await wait_for(lambda: received.subjects, 10, "the permitted message")
    assert received.subjects == [SUBJECTS.control("w2", "push_done")]
    # the operator may drain: the refusal above is the worker's, not the subject's
    await operator.client.publish(SUBJECTS.control("w2", "drain"), encode(Drain(deadline_s=0)))
    await wait_for(lambda: len(received.subjects) == 2, 10, "the operator's drain")


async def test_a_worker_cannot_read_another_workers_requests(users, caplog) -> None:
    w1, router = await users("worker-w1"), await users("router")
    received = Inbox()
    await received.subscribe(w1, SUBJECTS.generate("w2"))
    await assert_refused(caplog, f'Subscription to "{SUBJECTS.generate("w2")}"')
    await received.subscribe(w1, SUBJECTS.generate("w1"))
    await router.client.publish(SUBJECTS.generate("w2"), b"for w2 only")
    await router.client.publish(SUBJECTS.generate("w1"), b"for w1")
    await router.client.flush()
    await wait_for(lambda: received.subjects, 10, "w1's own request")
    assert received.subjects == [SUBJECTS.generate("w1")]


async def test_the_router_cannot_ask_for_kv_leases_nor_drain(users, caplog) -> None:
    w1, w2, router = await users("worker-w1"), await users("worker-w2"), await users("router")
    received = await Inbox().subscribe(w1, SUBJECTS.kv_lease("w1"), SUBJECTS.kv_release("w1"), SUBJECTS.control_all("w1"))
    lease = LeaseRequest(requester_worker_id="w2", compat_hash="h", block_hashes=[1, 2], ttl_s=5)
    await router.client.publish(SUBJECTS.kv_lease("w1"), encode(lease))
    await router.client.publish(SUBJECTS.control("w1", "drain"), encode(Drain(deadline_s=0)))
    await router.client.publish(SUBJECTS.kv_release("w1"), encode(LeaseRelease(lease_id="l", outcome="cancelled")))
    await router.client.publish(SUBJECTS.control("w1", "cancel"), encode(Cancel(request_id="r")))
    await assert_refused(caplog, f'Publish to "{SUBJECTS.kv_lease("w1")}"')
    await assert_refused(caplog, f'Publish to "{SUBJECTS.control("w1", "drain")}"')
    await wait_for(lambda: len(received.subjects) == 2, 10, "the router's release and cancel")
    assert received.subjects == [SUBJECTS.kv_release("w1"), SUBJECTS.control("w1", "cancel")]
    await w2.client.publish(SUBJECTS.kv_lease("w1"), encode(lease))  # a worker may
    await wait_for(lambda: len(received.subjects) == 3, 10, "a worker's lease request")


async def test_the_router_answers_a_workers_probe_of_its_inbox_but_publishes_to_no_inbox(users, caplog) -> None:
    """A worker asks whether a stream's caller is still there (`FrameSender.caller_alive`):
    the router's inbox answers, once, by `allow_responses`; the router still cannot
    publish into an inbox it was not asked from (it could forge a worker's replies)."""
    w1, router = await users("worker-w1"), await users("router")
    inbox = await ResponseInbox(router).open()
    reply = inbox.register(FrameQueue())
    await subscribed(router)
    assert await FrameSender(w1, reply).caller_alive(5.0) is True
    received = await Inbox().subscribe(w1, "_INBOX.worker-w1.forged")
    await router.client.publish("_INBOX.worker-w1.forged", b"a forged reply")
    await assert_refused(caplog, 'Publish to "_INBOX.worker-w1.forged"')
    assert not received.subjects
    await inbox.close()
    await subscribed(router)
    assert await FrameSender(w1, reply).caller_alive(5.0) is False  # nobody listens: the caller is gone


async def test_a_worker_registers_only_itself(users) -> None:
    w1 = await users("worker-w1")
    members = await w1.key_value(SUBJECTS.members_bucket, ttl_s=30)
    await members.put("w1", b"me")
    with pytest.raises(Exception):  # the server drops the forbidden put: no acknowledgement comes
        await asyncio.wait_for(members.put("w2", b"not me"), 2)
    orchestrator = await users("orchestrator")
    mirror = await orchestrator.key_value(SUBJECTS.members_bucket)
    assert (await mirror.get("w1")).value == b"me"
    await mirror.delete("w1")  # the orchestrator removes dead workers


async def test_a_worker_drops_a_control_message_of_another_kind(secured, users) -> None:
    """The router may cancel; a Drain it sends on the cancel subject is dropped by the worker."""
    server, security = secured
    config = WorkerConfig(worker_id="w1", bus=security.bus_config("worker-w1", server.url, NAMESPACE),
                          kv_blocks=64, membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0),
                          kv_event_interval_s=0.01)
    bus = await connect(config.bus, "worker-w1")
    worker = await start_sim_worker(config, bus, SimEngineConfig(speedup=20))
    try:
        router = await users("router")
        events = await Inbox().subscribe(router, SUBJECTS.kv_events("w1"))
        await router.client.publish(SUBJECTS.control("w1", "cancel"), encode(Drain(deadline_s=0)))
        await router.client.publish(SUBJECTS.control("w1", "kv_snapshot"), encode(KvSnapshotRequest()))
        await wait_for(lambda: events.subjects, 10, "the snapshot answered after the forged drain")
        assert worker.registration().status is WorkerStatus.ACTIVE
        assert worker.malformed.by_subject[SUBJECTS.control("w1", "cancel")] == 1
    finally:
        await worker.stop()
        await bus.close()


async def test_the_release_subject_takes_releases_only(secured, users) -> None:
    """What the router may send a holder is a release; a lease request there is refused."""
    server, security = secured
    config = worker_config("w1", security.bus_config("worker-w1", server.url, NAMESPACE), transport="memory")
    bus = await connect(config.bus, "worker-w1")
    worker = await start_worker(config, bus)
    try:
        router = await users("router")
        lease = LeaseRequest(requester_worker_id="w2", compat_hash=worker.engine.info.compat_hash,
                             block_hashes=[1], ttl_s=5)
        reply = Codec(LeaseReply).decode((await router.client.request(SUBJECTS.kv_release("w1"), encode(lease),
                                                                        timeout=10)).data)
        assert isinstance(reply, LeaseRefused) and "only lease releases" in reply.reason
        release = LeaseRelease(lease_id="unknown", outcome="cancelled")
        reply = Codec(LeaseReply).decode((await router.client.request(SUBJECTS.kv_release("w1"), encode(release),
                                                                        timeout=10)).data)
        assert isinstance(reply, LeaseAck) and not reply.ok
    finally:
        await worker.stop()
        await bus.close()


async def test_permissions_hold_for_every_role_on_the_server(secured, caplog) -> None:
    """Each service's user connects and does its ordinary work with no violation logged."""
    server, security = secured
    for user in ("router", "orchestrator", "metrics", "operator", "worker-w1"):
        bus = await connect(security.bus_config(user, server.url, NAMESPACE), f"test-{user}")
        try:
            members = await bus.key_value(SUBJECTS.members_bucket, ttl_s=30)
            watcher = await members.watchall()
            await watcher.stop()
            await bus.client.flush()
        finally:
            await bus.close()
    assert not violations(caplog)


async def test_services_reconnect_with_their_credentials_after_a_restart(secured, users) -> None:
    """A secured server restarting (same port, same files): clients come back over TLS with
    their credentials, and their permissions still hold."""
    server, _ = secured
    w1, router = await users("worker-w1"), await users("router")
    received = await Inbox().subscribe(w1, SUBJECTS.generate("w1"))
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    w1.on_reconnect(on_reconnect)
    server.restart()
    await asyncio.wait_for(reconnected.wait(), 20)
    await wait_for(lambda: router.client.is_connected, 20, "the router reconnected")
    await router.client.publish(SUBJECTS.generate("w1"), b"after the restart")
    await router.client.flush()
    await wait_for(lambda: received.subjects, 10, "a request after the restart")


# ---- the responses bucket ------------------------------------------------------------


async def test_a_router_stores_responses_and_a_worker_cannot_reach_them(users) -> None:
    """With NATS secured, a router opens (creates) the responses bucket, stores a response
    and reads it back; a worker may not even look the bucket up."""
    from services.router.config import ResponsesConfig
    from services.router.flows.responses_store import JetStreamResponseStore
    from services.router.openai.protocol_responses import ResponsesRequest
    from services.router.openai.responses_objects import StoredResponse
    from services.router.openai.responses_translation import ResponseDraft, usage_of

    router = await users("router")
    store = await asyncio.wait_for(JetStreamResponseStore.open(router, SUBJECTS, ResponsesConfig()), FAIL_FAST_S)
    draft = ResponseDraft(ResponsesRequest(input="hi"), "m", 1_700_000_000, 4)
    response = draft.finished("hello", [], "stop", usage_of(3, 1, 0))
    assert await store.put(StoredResponse(response=response, conversation=[]))
    stored = await store.get(response.id)
    assert stored is not None and stored.response.output == response.output
    worker = await users("worker-w1")
    with pytest.raises(Exception):  # a permissions violation: the lookup times out or is refused
        await asyncio.wait_for(worker.js.key_value(SUBJECTS.responses_bucket), FAIL_FAST_S)
