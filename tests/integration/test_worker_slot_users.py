"""The Docker Compose stack's worker slots against a real nats-server configured from the
compose secrets layout (`launch.compose_secrets.ensure_secrets`): every slot is a user with
exactly a `tandem up` worker's permissions, so the credentials of one slot cannot read
another slot's generate requests nor drain it; a real worker (`run_worker`) with a slot
directory claims the first free slot, registers under its id and connects as its user; a
worker with no free slot exits 2 with one line, before it touches NATS."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from launch.compose_secrets import control_users, ensure_secrets
from services.worker.config import WorkerCommandConfig
from services.worker.main import run_worker, slot_config
from services.worker.sim.config import SimEngineConfig
from shared.bus import Bus, connect
from shared.codec import encode
from shared.config import BusConfig, MembershipConfig, WorkerConfig, WorkerSlotsConfig
from shared.nats_security import user_files
from shared.nats_server import EmbeddedNats
from shared.schemas import Drain
from shared.subjects import Subjects
from shared.worker_slots import SlotClaim, SlotRefused, claim_slot, make_slots
from tests.integration.test_nats_auth import Inbox, assert_refused
from tests.waiting import wait_for

NAMESPACE = "slots"
SUBJECTS = Subjects(NAMESPACE)


class ComposeSecrets(msgspec.Struct, frozen=True):
    server: EmbeddedNats
    nats_dir: Path
    slots_dir: Path


@pytest.fixture(scope="module")
def compose_secrets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeSecrets]:
    root = tmp_path_factory.mktemp("compose-secrets")
    made = ensure_secrets(root / "secrets", NAMESPACE, ("127.0.0.1", "localhost"), worker_slots=3,
                          slots_dir=root / "slots")
    assert made.worker_slots == ("w01", "w02", "w03")
    with EmbeddedNats(str(root / "nats"), config_file=str(made.nats_dir / "nats-server.conf"), tls=True) as server:
        yield ComposeSecrets(server, made.nats_dir, root / "slots")


def slot_bus(secrets: ComposeSecrets, worker_id: str) -> BusConfig:
    """The bus a worker that claimed `worker_id` connects with (the worker's own derivation)."""
    template = WorkerConfig(worker_id="", bus=BusConfig(nats_url=secrets.server.url, namespace=NAMESPACE),
                            slots=WorkerSlotsConfig(directory=str(secrets.slots_dir), nats_dir=str(secrets.nats_dir)))
    return slot_config(template, worker_id).bus


@pytest.fixture
async def slot_workers(compose_secrets: ComposeSecrets) -> AsyncIterator:
    """`as_slot()`: claim the next free slot and connect with its files; `as_user(name)`."""
    claims: list[SlotClaim] = []
    opened: list[Bus] = []

    async def as_slot() -> tuple[str, Bus]:
        claim = claim_slot(compose_secrets.slots_dir)
        assert isinstance(claim, SlotClaim), claim
        claims.append(claim)
        bus = await connect(slot_bus(compose_secrets, claim.worker_id), f"worker-{claim.worker_id}")
        opened.append(bus)
        return claim.worker_id, bus

    async def as_user(name: str) -> Bus:
        files = user_files(compose_secrets.nats_dir, name)
        bus = await connect(BusConfig(nats_url=compose_secrets.server.url, namespace=NAMESPACE, **files), name)
        opened.append(bus)
        return bus

    yield as_slot, as_user
    for bus in opened:
        await bus.close()
    for claim in claims:
        claim.release()


def test_the_secrets_hold_a_user_per_slot_and_none_for_any_worker(compose_secrets: ComposeSecrets) -> None:
    users = sorted(path.stem for path in (compose_secrets.nats_dir / "creds").glob("*.creds"))
    assert users == sorted([*control_users(), "worker-w01", "worker-w02", "worker-w03"])
    config = (compose_secrets.nats_dir / "nats-server.conf").read_text()
    subscribes = re.findall(r"subscribe: \{ allow: \[(.*)\] \}", config)
    assert len(subscribes) == len(users)
    anyone = (SUBJECTS.generate("X").replace(".X.", ".*."), SUBJECTS.control_all("X").replace(".X.", ".*."))
    assert not [line for line in subscribes if any(f'"{subject}"' in line for subject in anyone)]


async def test_a_slot_cannot_read_another_slots_requests(slot_workers, caplog) -> None:
    as_slot, as_user = slot_workers
    (a, bus_a), (b, _) = await as_slot(), await as_slot()
    router = await as_user("router")
    received = Inbox()
    await received.subscribe(bus_a, SUBJECTS.generate(b))
    await assert_refused(caplog, f'Subscription to "{SUBJECTS.generate(b)}"')
    await received.subscribe(bus_a, SUBJECTS.generate(a))
    await router.client.publish(SUBJECTS.generate(b), b"for b only")
    await router.client.publish(SUBJECTS.generate(a), b"for a")
    await router.client.flush()
    await wait_for(lambda: received.subjects, 10, "a's own request")
    assert received.subjects == [SUBJECTS.generate(a)]


async def test_a_slot_cannot_drain_another_slot(slot_workers, caplog) -> None:
    as_slot, as_user = slot_workers
    (_, bus_a), (b, bus_b) = await as_slot(), await as_slot()
    received = await Inbox().subscribe(bus_b, SUBJECTS.control_all(b))
    await bus_a.client.publish(SUBJECTS.control(b, "drain"), encode(Drain(deadline_s=0)))
    await bus_a.client.publish(SUBJECTS.control(b, "push_done"), b"after")  # allowed to any worker
    await assert_refused(caplog, f'Publish to "{SUBJECTS.control(b, "drain")}"')
    await wait_for(lambda: received.subjects, 10, "the permitted message")
    assert received.subjects == [SUBJECTS.control(b, "push_done")]
    operator = await as_user("operator")  # the operator may: the refusal was a's
    await operator.client.publish(SUBJECTS.control(b, "drain"), encode(Drain(deadline_s=0)))
    await wait_for(lambda: len(received.subjects) == 2, 10, "the operator's drain")


async def test_a_worker_with_slots_claims_one_and_serves_under_its_id(compose_secrets: ComposeSecrets,
                                                                      tiny_model_dir: str) -> None:
    held = claim_slot(compose_secrets.slots_dir, "w01")  # taken: the worker gets the next one
    assert isinstance(held, SlotClaim)
    config = WorkerConfig(worker_id="", model_dir=tiny_model_dir, kv_blocks=64,
                          bus=BusConfig(nats_url=compose_secrets.server.url, namespace=NAMESPACE),
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0),
                          slots=WorkerSlotsConfig(directory=str(compose_secrets.slots_dir),
                                                  nats_dir=str(compose_secrets.nats_dir)))
    ready = asyncio.Event()
    worker = asyncio.create_task(run_worker(WorkerCommandConfig(worker=config, sim=SimEngineConfig(speedup=20)),
                                            ready=ready))
    orchestrator = None
    try:
        await asyncio.wait_for(ready.wait(), 30)
        assert isinstance(claim_slot(compose_secrets.slots_dir, "w02"), SlotRefused)  # the worker's
        files = user_files(compose_secrets.nats_dir, "orchestrator")
        orchestrator = await connect(BusConfig(nats_url=compose_secrets.server.url, namespace=NAMESPACE, **files),
                                     "orchestrator")
        members = await orchestrator.key_value(SUBJECTS.members_bucket)
        assert (await members.get("w02")).value
        await orchestrator.client.publish(SUBJECTS.control("w02", "drain"), encode(Drain(deadline_s=5)))
        await asyncio.wait_for(worker, 30)  # the drain stops it; the slot is free again
    finally:
        held.release()
        if not worker.done():
            worker.cancel()
        if orchestrator is not None:
            await orchestrator.close()
    again = claim_slot(compose_secrets.slots_dir, "w02")
    assert isinstance(again, SlotClaim)
    again.release()


def test_a_worker_with_no_free_slot_exits_2_with_one_line(tmp_path: Path) -> None:
    make_slots(tmp_path, 1)
    with claim_slot(tmp_path) as held:
        assert isinstance(held, SlotClaim)
        result = subprocess.run([str(Path(sys.executable).parent / "tandem"), "worker", "--worker-slots",
                                 str(tmp_path), "--nats-url", "nats://127.0.0.1:1"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: all 1 worker slots in {tmp_path} (w01) are held by other workers: make more "
                     f"(Docker Compose: TANDEM_WORKER_SLOTS=N docker compose up -d --force-recreate)"]
