"""A rolling upgrade under load: a prefill and a decode worker of version v1, started by
the orchestrator's local launcher, are replaced by v2 ones with `tandem ctl upgrade`
while streaming clients keep the stack busy (after an attempt whose new decode worker
cannot start, which stops with the v1 pair untouched; a second upgrade sent while one
runs is refused). No request fails or comes back short; every request is routed only to
prefill and decode workers of one version (the router's spans name the pair of each
route, the readers' transfer records the prefill worker each pull read from, the
membership changes each worker's version); only v2 workers are left.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import Iterator

import msgspec
import pytest

from launch.stack import LocalStack
from shared.bus import connect
from shared.nats_server import EmbeddedNats
from shared.schemas import MembershipChange, RequestRecord, TransferRecord, WorkerRole
from shared.schemas.orchestrator import AddWorker, CommandProgress, ListWorkers, UpgradeWorkers
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.control_plane_helpers import StreamingLoad, command, complete
from tests.e2e.test_disaggregated import ALWAYS_DISAGGREGATE
from tests.otlp_receiver import OtlpReceiver
from tests.stack_fixtures import collect, make_stack, running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    otlp = OtlpReceiver().start()
    yield otlp
    otlp.stop()


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
            # of that round is removed again and the v1 pair serves on.
            failed = await command(stack, UpgradeWorkers(model_version="v2", role_args={"decode": ["--no-such-flag"]}),
                                   timeout_s=60)
            assert failed.outcome == "failed" and "decode-v2-1 exited" in failed.reason, failed
            assert failed.steps == ["add prefill prefill-v2-1"], failed
            assert sorted(s.registration.worker_id for s in failed.workers) == ["d-v1", "p-v1"], failed.workers
            await wait_for(lambda: any(p.outcome == "failed" for p in progress), 5, "the failed step's report")
            assert [(p.step, p.outcome) for p in progress] == [("add prefill prefill-v2-1", "ok"),
                                                               ("add decode decode-v2-1", "failed")], progress
            progress.clear()

            before, upgrade_started = len(load.answers), time.monotonic()
            ctl = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "cli.main", "ctl", "upgrade", "--model-version", "v2", "--deadline", "15",
                "--timeout", "70", "--nats-url", stack.nats_url, "--namespace", stack.config.namespace,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            communicated = asyncio.create_task(ctl.communicate())
            await wait_for(lambda: bool(progress), 30, "the upgrade's first step")
            second = await command(stack, UpgradeWorkers(model_version="v3"))
            assert second.outcome == "refused" and "already running" in second.reason, second
            output = (await asyncio.wait_for(communicated, 80))[0].decode()
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
        await wait_for(lambda: not any(_alive(pid) for pid in old_pids), 10, "the v1 processes to exit")

        # Every request went to a prefill and a decode worker of one version.
        version = {c.worker_id: c.registration.model_version for c in changes if c.registration is not None}
        assert version.get("p-v1") == "v1" and version.get("d-v1") == "v1", version
        hashes = {c.registration.model_version: c.registration.compat_hash for c in changes
                  if c.registration is not None}
        assert hashes["v1"] != hashes["v2"], hashes  # the router would not pair across them
        # The router's route spans say which prefill and decode worker each request was sent
        # to (every attempt), the readers' transfer records which prefill worker it pulled from.
        await wait_for(lambda: len(requests) >= len(answers), 10, lambda: f"{len(answers)} request records")
        assert all(r.outcome == "ok" and r.flow == "disaggregated" for r in requests), requests
        ids = {r.request_id for r in requests}
        await wait_for(lambda: ids <= set(_routes(receiver)), 10, lambda: f"route spans of {len(ids)} requests")
        routes = _routes(receiver)
        served = []
        for record in requests:
            pairs = routes[record.request_id]
            # each route a same-version pair, and a request never moved between versions
            assert len({version[worker] for pair in pairs for worker in pair}) == 1, (record, pairs, version)
            last = [prefill for prefill, decode in pairs if decode == record.worker_id]
            assert last, (record, pairs)
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
              f"it ran), none failed; "
              f"served by v1 pairs {by_version['v1']}, by v2 pairs {by_version['v2']}, mixed 0 "
              f"({len(pulls)} pulls checked, {resumed} routed more than once)\n{output}")
    finally:
        await bus.close()


def _routes(receiver: OtlpReceiver) -> dict[str, list[tuple[str, str]]]:
    """Request id -> the (prefill, decode) worker of each disaggregated route the router took
    for it: the `router.route` events of its `router.generate` span and of the
    `router.resume` spans under it (a continuation on other workers)."""
    spans = list(receiver.spans)
    request_of = {span.span_id: span.attributes["tandem.request_id"] for span in spans
                  if span.name == "router.generate"}
    routes: dict[str, list[tuple[str, str]]] = {}
    for span in spans:
        if span.name == "router.generate":
            request_id = span.attributes["tandem.request_id"]
        elif span.name == "router.resume" and span.parent_span_id in request_of:
            request_id = request_of[span.parent_span_id]
        else:
            continue
        pairs = routes.setdefault(request_id, [])
        for name, attributes in span.events:
            if name == "router.route" and attributes.get("tandem.flow") == "disaggregated":
                pairs.append((attributes["tandem.prefill_worker_id"], attributes["tandem.worker_id"]))
    return routes
