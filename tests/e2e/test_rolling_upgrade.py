"""A rolling upgrade under load: a prefill and a decode worker of version v1, started by
the orchestrator's local launcher, are replaced by v2 ones with `tandem ctl upgrade`
while streaming clients keep the stack busy (after an attempt whose new decode worker
cannot start, which stops with the v1 pair untouched; a second upgrade sent while it runs
is refused). No request fails or comes back short; every attempt of a request goes to a
prefill and a decode worker of one version, and a request changes version only on a retry
before its first token (the router's spans name the pair of each attempt and why it was
made, the readers' transfer records the prefill worker each pull read from, the
membership changes each worker's version); only v2 workers are left."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import pytest

from launch.stack import LocalStack
from shared.bus import Bus, connect
from shared.codec import encode
from shared.nats_server import EmbeddedNats, pid_alive
from shared.schemas import MembershipChange, RequestRecord, TransferRecord, WorkerRole
from shared.schemas.orchestrator import (
    AddWorker,
    CommandOutcome,
    CommandProgress,
    ListWorkers,
    OrchestratorCommand,
    UpgradeWorkers,
)
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.control_plane_helpers import StreamingLoad, command, complete
from tests.otlp_receiver import OtlpReceiver
from tests.stack_fixtures import collect, make_stack, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture
def v1_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
             receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalStack]:
    """No worker yet; an orchestrator that starts v1 workers, and a router that always
    disaggregates and exports its spans (every 100 ms) to `receiver`."""
    log_dir = tmp_path_factory.mktemp("upgrade")
    tracing = ("--trace-exporter", "otlp", "--otlp-endpoint", receiver.endpoint)
    stack = make_stack(nats_server, tiny_model_dir, log_dir, workers=0, router_args=(*ALWAYS_DISAGGREGATE, *tracing))
    settings = {"launcher": "local", "worker_model_dir": tiny_model_dir, "worker_log_dir": str(log_dir),
                "worker_args": "--model-version v1", "max_workers": 4}
    stack.config = msgspec.structs.replace(stack.config, orchestrator_settings=settings)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # OpenTelemetry's batch processor setting, in ms
    with running(stack) as local:
        yield local


async def test_rolling_upgrade_under_load_keeps_every_request_on_one_version(
        v1_stack: LocalStack, receiver: OtlpReceiver, tiny_model_dir: str, openai_client) -> None:
    stack = v1_stack
    subjects = Subjects(stack.config.namespace)
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    bus = await connect(stack.nats_url, "upgrade-test")
    try:
        requests: list[RequestRecord] = await collect(bus, RequestRecord, subjects.request_events)
        transfers: list[TransferRecord] = await collect(bus, TransferRecord, subjects.kv_transfers_all)
        changes: list[MembershipChange] = await collect(bus, MembershipChange, subjects.membership_changes)
        progress: list[CommandProgress] = await collect(bus, CommandProgress, subjects.orchestrator_progress)

        started = await asyncio.gather(command(stack, AddWorker(role=WorkerRole.PREFILL, worker_id="p-v1"), 60),
                                       command(stack, AddWorker(role=WorkerRole.DECODE, worker_id="d-v1"), 60))
        assert all(outcome.ok for outcome in started), started
        old_pids = [outcome.workers[0].registration.pid for outcome in started]
        assert {outcome.workers[0].registration.model_version for outcome in started} == {"v1"}

        load = StreamingLoad(openai_client(stack.router_url, timeout=30), tokenizer.model_name, clients=3,
                             max_tokens=MAX_TOKENS)
        load.start()
        try:
            await wait_for(load.wait_answers(6), 20, "answers from the v1 pair")

            # An upgrade whose new decode worker cannot start stops there: the new prefill worker
            # of that round is removed again and the v1 pair serves on. A second upgrade sent
            # right behind it (same connection, so it arrives second) is refused while it runs.
            failed, second = await _two_commands(
                bus, subjects, UpgradeWorkers(model_version="v2", role_args={"decode": ["--no-such-flag"]}),
                UpgradeWorkers(model_version="v3"), timeout_s=120)
            assert second.outcome == "refused" and "already running" in second.reason, second
            assert failed.outcome == "failed" and "decode-v2-1 exited" in failed.reason, failed
            assert failed.steps == ["add prefill prefill-v2-1"], failed
            assert sorted(s.registration.worker_id for s in failed.workers) == ["d-v1", "p-v1"], failed.workers
            await wait_for(lambda: any(p.outcome == "failed" for p in progress), 30, "the failed step's report")
            assert [(p.step, p.outcome) for p in progress] == [("add prefill prefill-v2-1", "ok"),
                                                               ("add decode decode-v2-1", "failed")], progress
            progress.clear()

            before, upgrade_started = len(load.answers), time.monotonic()
            ctl = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cli.main", "ctl", "upgrade", "--model-version", "v2", "--deadline", "15",
                "--timeout", "70", "--nats-url", stack.nats_url, "--namespace", stack.config.namespace,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            output = (await asyncio.wait_for(ctl.communicate(), 80))[0].decode()
            during, upgrade_s = len(load.answers) - before, time.monotonic() - upgrade_started
            await wait_for(load.wait_answers(len(load.answers) + 6), 20, "answers from the v2 pair")
            answers = await load.stop()
        finally:
            await load.stop()  # stopped already, unless something above failed
        assert ctl.returncode == 0, output

        # Not one request failed or came back short, before, during or after the upgrade.
        assert answers and not complete(answers, MAX_TOKENS), complete(answers, MAX_TOKENS)
        assert during > 0, "no request was answered while the upgrade ran"

        # The steps, in order: the new pair first; once it is active the old pair is cordoned
        # together, then its prefill worker drains, then its decode worker.
        steps = [(p.index, p.step, p.outcome) for p in sorted(progress, key=lambda p: p.index)]
        assert [outcome for _, _, outcome in steps] == ["ok"] * 6, steps
        assert [step for _, step, _ in steps][3:] == ["cordon p-v1, d-v1", "drain p-v1", "drain d-v1"], steps
        assert [step.split()[0] for _, step, _ in steps][:3] == ["add", "add", "wait"], steps
        assert "[6/6] drain d-v1 ok" in output, output

        # Only v2 workers are left, and the v1 processes are gone.
        listing = await command(stack, ListWorkers())
        left = {s.registration.worker_id: s.registration for s in listing.workers}
        assert sorted(r.role.value for r in left.values()) == ["decode", "prefill"], left
        assert {r.model_version for r in left.values()} == {"v2"}, left
        assert all(s.launched for s in listing.workers)
        await wait_for(lambda: not any(pid_alive(pid) for pid in old_pids), 10, "the v1 processes to exit")

        # Every request went to a prefill and a decode worker of one version.
        version = {c.worker_id: c.registration.model_version for c in changes if c.registration is not None}
        assert version.get("p-v1") == "v1" and version.get("d-v1") == "v1", version
        hashes = {c.registration.model_version: c.registration.compat_hash for c in changes
                  if c.registration is not None}
        assert hashes["v1"] != hashes["v2"], hashes  # the router would not pair across them
        # The router's spans say which prefill and decode worker each attempt of a request was
        # sent to and why a later attempt exists, the readers' transfer records which prefill
        # worker each pull read from.
        await wait_for(lambda: len(requests) >= len(answers), 30, lambda: f"{len(answers)} request records")
        assert all(r.outcome == "ok" and r.flow == "disaggregated" for r in requests), requests
        ids = {r.request_id for r in requests}
        await wait_for(lambda: ids <= set(_routes(receiver)), 30, lambda: f"route spans of {len(ids)} requests")
        routes = _routes(receiver)
        served, moved = [], []
        for record in requests:
            attempts = routes[record.request_id]
            versions = []
            for route in attempts:  # each attempt went to a pair of one version
                pair_versions = {version[worker] for worker in (route.prefill, route.decode) if worker}
                assert len(pair_versions) == 1, (record, attempts, version)
                versions.append(pair_versions.pop())
            # The promise: every answer comes from one version. An attempt changes version only
            # when nothing had been generated: an old worker lost (it refused: draining) before the
            # request's first token; once a token was out, the request stays on its version.
            for previous, route, before, now in zip(attempts, attempts[1:], versions, versions[1:], strict=False):
                assert route.lost in (previous.prefill, previous.decode), (record, attempts)
                if before != now:
                    assert route.generated == 0, (record, attempts, version)
                    moved.append((record.request_id, route.lost, route.why))
            last = [route.prefill for route in attempts if route.decode == record.worker_id]
            assert last, (record, attempts)
            served.append((version[last[-1]], version[record.worker_id]))
        pulls = [(t.peer_worker_id, t.worker_id) for t in transfers  # a continuation's id ends in -r<attempt>
                 if t.kind == "pull" and re.sub(r"-r\d+$", "", t.request_id) in ids]
        assert pulls
        mixed = [(prefill, decode) for prefill, decode in pulls if version[prefill] != version[decode]]
        assert not mixed, mixed
        resumed = sum(len(routes[r.request_id]) > 1 for r in requests)
        by_version = {v: served.count((v, v)) for v in ("v1", "v2")}
        assert by_version["v1"] > 0 and by_version["v2"] > 0 and sum(by_version.values()) == len(served), by_version
        print(f"\nupgrade v1 -> v2 under load took {upgrade_s:.1f} s: {len(answers)} requests ({during} while "
              f"it ran), none failed; served by v1 pairs {by_version['v1']}, by v2 pairs {by_version['v2']}, "
              f"mixed 0 ({len(pulls)} pulls checked, {resumed} routed more than once, {len(moved)} retried on v2 "
              f"before their first token: {moved})\n{output}")
    finally:
        await bus.close()


@dataclass(frozen=True)
class Route:
    """One attempt of a request: the workers it was sent to, and for a later attempt how many
    tokens the request had generated before it and which worker's loss started it (why)."""

    prefill: str  # "" for a single-worker route
    decode: str
    generated: int = 0
    lost: str = ""
    why: str = ""


async def _two_commands(bus: Bus, subjects: Subjects, first: OrchestratorCommand, second: OrchestratorCommand,
                        timeout_s: float) -> tuple[CommandOutcome, CommandOutcome]:
    """Both outcomes; `second` is published after `first` on one connection, so the
    orchestrator receives (and starts) them in that order."""
    inboxes = [bus.client.new_inbox() for _ in range(2)]
    replies = [await bus.client.subscribe(inbox, max_msgs=1) for inbox in inboxes]
    for inbox, order in zip(inboxes, (first, second), strict=True):
        await bus.client.publish(subjects.orchestrator_commands, encode(order), reply=inbox)
    outcomes = msgspec.msgpack.Decoder(CommandOutcome)
    first_outcome, second_outcome = [outcomes.decode((await reply.next_msg(timeout_s)).data) for reply in replies]
    return first_outcome, second_outcome


def _routes(receiver: OtlpReceiver) -> dict[str, list[Route]]:
    """Request id -> each attempt's route, in order: the `router.route` event of its
    `router.generate` span, then that of each `router.resume` span under it (a continuation
    on other workers, `tandem.attempt` 1, 2, ...), with the `router.worker_lost` event of the
    generate span that says why that attempt was made."""
    spans = list(receiver.spans)
    generate = {span.span_id: span for span in spans if span.name == "router.generate"}
    attempts: dict[str, dict[int, Route]] = {}
    for span in spans:
        if span.name == "router.generate":
            parent, attempt, generated = span, 0, 0
        elif span.name == "router.resume" and span.parent_span_id in generate:
            parent = generate[span.parent_span_id]
            attempt, generated = span.attributes["tandem.attempt"], span.attributes["tandem.generated_tokens"]
        else:
            continue
        lost = next((attributes for name, attributes in parent.events if name == "router.worker_lost"
                     and attributes["tandem.attempt"] == attempt), {})
        for name, attributes in span.events:
            if name == "router.route":
                attempts.setdefault(parent.attributes["tandem.request_id"], {})[attempt] = Route(
                    attributes.get("tandem.prefill_worker_id", ""), attributes["tandem.worker_id"], generated,
                    lost.get("tandem.lost_worker_id", ""), lost.get("tandem.error", ""))
    return {request_id: [by_attempt[k] for k in sorted(by_attempt)] for request_id, by_attempt in attempts.items()}
