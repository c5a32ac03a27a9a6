"""Tracing end to end: a real stack (router, orchestrator, metrics collector, sim workers,
each a process) exports its spans over OTLP/HTTP to a receiver in the test, and each
request is one trace, continued from the client's `traceparent`:

    POST /v1/completions (router, child of the client's span)
      router.generate
        router.route                      flow, reason, candidates, cached/uncached tokens
        router.prefill -> worker.generate (prefill worker)
                            kv.lease.grant          (pull: the hold for the decode worker)
                            kv.pull prefix_pull     (a cached prefix) -> kv.lease.request -> kv.lease.grant
                            kv.push                 (push: one event per layer write)
        router.decode  -> worker.generate (decode worker)
                            kv.pull pull -> kv.lease.release (on the holder) | kv.push.receive
        router.resume  (a worker was lost) -> router.route, the new parts and their workers

No span is an orphan (every parent is in the trace; the HTTP span's is the client's), except
spans of a SIGKILLed worker whose parent died unexported with it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.bus import connect
from shared.codec import Codec
from shared.nats_server import EmbeddedNats
from shared.schemas import BlockStored, KvEventBatch, WorkerRole
from shared.schemas.kv_events import token_ids_of
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE, LoadWatcher, make_stack
from tests.e2e.test_disaggregated import reference
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.stack_fixtures import running
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

HTTP_SPAN = "POST /v1/completions"
BLOCK = 16  # the sim workers' block size
SPAN_KIND_SERVER = 2  # OTLP's enum


def traced_stack(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, receiver: OtlpReceiver,
                 router_args: tuple[str, ...], specs: tuple[WorkerSpec, ...]) -> LocalStack:
    """A stack whose router and workers export spans to `receiver`, batched every 100 ms."""
    tracing = ("--trace-exporter", "otlp", "--otlp-endpoint", receiver.endpoint)
    return make_stack(nats_server, model_dir, log_dir, workers=0, router_args=(*router_args, *tracing),
                      specs=tuple(WorkerSpec(worker_id=spec.worker_id, role=spec.role,
                                             extra_args=(*spec.extra_args, *tracing)) for spec in specs))


def run_stack(stack: LocalStack) -> Iterator[LocalStack]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # OpenTelemetry's batch processor setting, in ms
        with running(stack):  # the children read the environment as they start
            yield stack


@pytest.fixture
def push_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
               receiver: OtlpReceiver) -> Iterator[LocalStack]:
    faults = ("--kv-fault-fail-fraction", "0.3", "--kv-fault-seed", "5")  # some pushed blocks break
    yield from run_stack(traced_stack(
        nats_server, tiny_model_dir, tmp_path_factory.mktemp("tracing-push"), receiver,
        (*ALWAYS_DISAGGREGATE, "--pd-transfer", "push"),
        (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL, extra_args=faults),
         WorkerSpec(worker_id="d1", role=WorkerRole.DECODE))))


@pytest.fixture(scope="module")
def pull_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
               receiver: OtlpReceiver) -> Iterator[LocalStack]:
    yield from run_stack(traced_stack(
        nats_server, tiny_model_dir, tmp_path_factory.mktemp("tracing-pull"), receiver, ALWAYS_DISAGGREGATE,
        (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL), WorkerSpec(worker_id="d1", role=WorkerRole.DECODE),
         WorkerSpec(worker_id="d2", role=WorkerRole.DECODE))))


class ClientSpan:
    """The client's own span: its `traceparent` is what the router must continue."""

    def __init__(self) -> None:
        self.trace_id = secrets.token_hex(16)
        self.span_id = secrets.token_hex(8)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"


async def complete(router_url: str, model: str, prompt: list[int], max_tokens: int,
                   client: ClientSpan) -> tuple[str, str]:
    """The trace id the router answered with (`x-trace-id`) and the response's id."""
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{router_url}/v1/completions", headers={"traceparent": client.traceparent},
                                   json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                         "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert response.headers["traceresponse"].split("-")[1] == response.headers["x-trace-id"]
    return response.headers["x-trace-id"], body["id"]


# ---- checking a trace ----------------------------------------------------------------


class Trace:
    def __init__(self, spans: list[ReceivedSpan]) -> None:
        self.spans = spans
        self.by_id = {span.span_id: span for span in spans}

    def names(self) -> set[str]:
        return {span.name for span in self.spans}

    def children(self, parent: ReceivedSpan, name: str, **attributes) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.parent_span_id == parent.span_id and span.name == name
                and all(span.attributes.get(key) == value for key, value in attributes.items())]

    def child(self, parent: ReceivedSpan, name: str, **attributes) -> ReceivedSpan:
        found = self.children(parent, name, **attributes)
        assert len(found) == 1, f"{len(found)} {name} {attributes} under {parent}: {self.spans}"
        return found[0]

    def only(self, name: str) -> ReceivedSpan:
        found = [span for span in self.spans if span.name == name]
        assert len(found) == 1, f"{len(found)} spans named {name}: {self.spans}"
        return found[0]


def orphans(spans: list[ReceivedSpan], client: ClientSpan, dead_services: tuple[str, ...] = ()) -> list:
    """Spans whose parent is not in the trace: only the HTTP span's may be (the client's),
    and those of a killed worker (its open spans died with it)."""
    ids = {span.span_id for span in spans} | {client.span_id}
    return [span for span in spans if span.parent_span_id not in ids and span.service not in dead_services]


async def received_trace(receiver: OtlpReceiver, client: ClientSpan, expected: set[str],
                         dead_services: tuple[str, ...] = (), timeout_s: float = 10.0) -> Trace:
    """The client's trace once every expected span name arrived and every parent with it
    (spans arrive in batches, each process's on its own schedule)."""
    def complete() -> bool:
        spans = receiver.trace(client.trace_id)
        return expected <= {span.name for span in spans} and not orphans(spans, client, dead_services)

    try:
        await wait_for(complete, timeout_s, f"spans {expected} of trace {client.trace_id}")
    except AssertionError as error:
        spans = receiver.trace(client.trace_id)
        raise AssertionError(f"{error}; orphans {orphans(spans, client, dead_services)} in {spans}") from None
    return Trace(receiver.trace(client.trace_id))


def check_tree(found: Trace, client: ClientSpan, request_id: str, *, dead_services: tuple[str, ...] = ()) -> None:
    """One HTTP root continuing the client's span, no orphans, every span of the request in it."""
    http = found.only(HTTP_SPAN)
    assert http.parent_span_id == client.span_id and http.service == "tandem-router"
    assert http.kind == SPAN_KIND_SERVER and http.attributes["http.response.status_code"] == 200
    assert all(span.trace_id == client.trace_id for span in found.spans)
    assert not orphans(found.spans, client, dead_services)
    generate = found.child(http, "router.generate")
    assert generate.attributes["tandem.request_id"] == request_id and generate.attributes["tandem.outcome"] == "ok"


def check_route(found: Trace, parent: ReceivedSpan, candidates: int) -> ReceivedSpan:
    route = found.child(parent, "router.route")
    assert route.attributes["tandem.flow"] == "disaggregated" and route.attributes["tandem.route_reason"]
    assert route.attributes["tandem.route_candidates"] == candidates
    assert route.attributes["tandem.cached_tokens"] >= 0 and route.attributes["tandem.uncached_tokens"] > 0
    return route


def part(found: Trace, parent: ReceivedSpan, name: str, worker_id: str | None = None) -> tuple[ReceivedSpan,
                                                                                                ReceivedSpan]:
    """A router part span and its worker's `worker.generate` under it."""
    attributes = {"tandem.worker_id": worker_id} if worker_id else {}
    router_part = found.child(parent, name, **attributes)
    worker = router_part.attributes["tandem.worker_id"]
    return router_part, found.child(router_part, "worker.generate", **{"tandem.worker_id": worker})


async def traced_pd_completion(stack: LocalStack, receiver: OtlpReceiver, model: str, prompt: list[int],
                               expected: set[str], candidates: int) -> tuple[Trace, ReceivedSpan, ReceivedSpan, str]:
    """One disaggregated completion sent under a client span: its whole trace (checked as one
    tree that continues the client's context, its route with `candidates` costed), the
    router's `router.generate` span, the `worker.generate` span of its prefill part on p1,
    and the request id."""
    client = ClientSpan()
    trace_id, request_id = await complete(stack.router_url, model, prompt, 8, client)
    assert trace_id == client.trace_id
    found = await received_trace(receiver, client, expected)
    check_tree(found, client, request_id)
    generate = found.child(found.only(HTTP_SPAN), "router.generate")
    check_route(found, generate, candidates)
    _, prefill = part(found, generate, "router.prefill", "p1")
    return found, generate, prefill, request_id


# ---- the tests -----------------------------------------------------------------------


async def test_push_pd_request_is_one_trace(push_stack: LocalStack, receiver: OtlpReceiver, model: str) -> None:
    prompt = [3 + (i * 11) % 500 for i in range(100)]
    found, generate, prefill, _ = await traced_pd_completion(
        push_stack, receiver, model, prompt, {HTTP_SPAN, "kv.push", "kv.push.receive", "worker.generate"}, candidates=2)
    assert generate.attributes["tandem.kv.transfer_mode"] == "push"
    _, decode = part(found, generate, "router.decode", "d1")
    push = found.child(prefill, "kv.push")
    writes = [attributes for name, attributes in push.events if name == "kv.push.write"]
    assert {write["tandem.kv.layer"] for write in writes if write["tandem.kv.layer"] >= 0} == set(
        range(max(write["tandem.kv.layer"] for write in writes) + 1)), "a write per layer"
    assert push.attributes["tandem.kv.writes"] == len(writes) and push.attributes["tandem.kv.bytes"] > 0
    receive = found.child(decode, "kv.push.receive")
    blocks = len(prompt) // BLOCK
    assert receive.attributes["tandem.kv.blocks"] == blocks
    assert receive.attributes["tandem.kv.blocks_failed"] + receive.attributes["tandem.kv.blocks_corrupt"] > 0
    assert (receive.attributes["tandem.kv.blocks_ok"] + receive.attributes["tandem.kv.blocks_failed"]
            + receive.attributes["tandem.kv.blocks_corrupt"]) == blocks
    assert receive.attributes["tandem.kv.failed_blocks"] == push.attributes["tandem.kv.failed_blocks"]
    assert receive.attributes["tandem.kv.outcome"] == "failed" and receive.attributes["tandem.kv.duration_s"] > 0


async def test_pull_pd_request_is_one_trace(pull_stack: LocalStack, receiver: OtlpReceiver, model: str) -> None:
    prompt = [3 + (i * 13) % 500 for i in range(100)]
    found, generate, prefill, request_id = await traced_pd_completion(
        pull_stack, receiver, model, prompt, {HTTP_SPAN, "kv.pull", "kv.lease.grant", "kv.lease.release"}, candidates=3)
    assert generate.attributes["tandem.flow"] == "disaggregated"
    assert prefill.service == "tandem-worker-p1" and prefill.attributes["tandem.request_id"] == request_id
    grant = found.child(prefill, "kv.lease.grant", **{"tandem.kv.reader_worker_id": "decode"})
    blocks = len(prompt) // BLOCK
    assert grant.attributes["tandem.kv.blocks"] == blocks
    decode_part, decode = part(found, generate, "router.decode")
    pull = found.child(decode, "kv.pull", **{"tandem.kv.kind": "pull", "tandem.kv.peer_worker_id": "p1"})
    assert pull.service == f"tandem-worker-{decode_part.attributes['tandem.worker_id']}"
    assert pull.attributes["tandem.kv.outcome"] == "done" and pull.attributes["tandem.kv.blocks_ok"] == blocks
    assert pull.attributes["tandem.kv.bytes"] > 0 and pull.attributes["tandem.kv.duration_s"] > 0
    assert pull.attributes["tandem.kv.blocks_failed"] == 0 and pull.attributes["tandem.kv.blocks_corrupt"] == 0
    release = found.child(pull, "kv.lease.release", **{"tandem.kv.lease_id": grant.attributes["tandem.kv.lease_id"]})
    assert release.service == "tandem-worker-p1" and release.attributes["tandem.kv.outcome"] == "done"


async def test_cached_prefix_pull_is_in_the_second_turns_trace(pull_stack: LocalStack, receiver: OtlpReceiver,
                                                               tiny_model_dir: str) -> None:
    """Turn 2's prefill worker pulls turn 1 (prompt and answer) from the decode worker that
    generated it: the answer's blocks exist only there."""
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    model = tokenizer.model_name
    turn1 = [3 + (i * 29 + 11) % 500 for i in range(150)]
    [answer1] = await reference(tokenizer, [turn1], 40)
    held = len(turn1 + answer1[:-1]) // BLOCK  # blocks the decode worker holds (the last token has no KV)
    last_block = tuple((turn1 + answer1)[(held - 1) * BLOCK: held * BLOCK])
    stored: dict[str, set[tuple[int, ...]]] = {}  # worker -> token blocks its KV events announced
    bus = await connect(pull_stack.nats_url, "e2e-tracing-kv")
    codec: Codec[KvEventBatch] = Codec(KvEventBatch)

    async def on_batch(msg) -> None:
        batch = codec.decode(msg.data)
        for event in batch.events:
            if isinstance(event, BlockStored):
                tokens = token_ids_of(event)  # packed on the wire
                stored.setdefault(batch.worker_id, set()).update(
                    tuple(tokens[i: i + event.block_size]) for i in range(0, len(tokens), event.block_size))

    await bus.client.subscribe(Subjects(pull_stack.config.namespace).kv_events_all, cb=on_batch)
    first = ClientSpan()
    try:
        await complete(pull_stack.router_url, model, turn1, 40, first)
        # the router learns from the same events that the decode worker holds the answer's blocks
        await wait_for(lambda: any(last_block in blocks for worker, blocks in stored.items() if worker != "p1"),
                       5, "the decode worker's KV events for turn 1's answer")
    finally:
        await bus.close()
    found1 = await received_trace(receiver, first, {HTTP_SPAN, "kv.pull"})
    holder = found1.child(found1.child(found1.only(HTTP_SPAN), "router.generate"),
                          "router.decode").attributes["tandem.worker_id"]
    turn2 = turn1 + answer1 + [3 + (i * 7) % 200 for i in range(21)]
    found, generate, prefill, _ = await traced_pd_completion(
        pull_stack, receiver, model, turn2, {HTTP_SPAN, "kv.lease.request", "kv.lease.release"}, candidates=3)
    assert generate.attributes["tandem.kv.prefix_holder"] == holder
    assert found.child(generate, "router.route").attributes["tandem.cached_tokens"] > 0
    pull = found.child(prefill, "kv.pull", **{"tandem.kv.kind": "prefix_pull", "tandem.kv.peer_worker_id": holder})
    assert pull.attributes["tandem.kv.outcome"] == "done" and pull.attributes["tandem.kv.blocks_ok"] > 0
    request = found.child(pull, "kv.lease.request")
    assert request.service == f"tandem-worker-{holder}" and request.kind == SPAN_KIND_SERVER
    grant = found.child(request, "kv.lease.grant", **{"tandem.kv.reader_worker_id": "p1"})
    # the prefill worker computed turn 1's prompt itself: it reads only the answer's blocks
    assert grant.attributes["tandem.kv.blocks"] == held
    assert pull.attributes["tandem.kv.blocks_ok"] == held - len(turn1) // BLOCK
    assert found.child(pull, "kv.lease.release").service == f"tandem-worker-{holder}"


async def test_resume_after_a_sigkilled_decode_worker_is_in_the_trace(pull_stack: LocalStack, receiver: OtlpReceiver,
                                                                      model: str) -> None:
    bus = await connect(pull_stack.nats_url, "e2e-tracing")
    loads = LoadWatcher()
    await loads.start(bus, Subjects(pull_stack.config.namespace).load_all)
    client = ClientSpan()
    prompt = [3 + (i * 17) % 500 for i in range(60)]
    pieces: list[str] = []
    response_id = ""

    async def stream() -> str:
        nonlocal response_id
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{pull_stack.router_url}/v1/completions",
                                   headers={"traceparent": client.traceparent},
                                   json={"model": model, "prompt": prompt, "max_tokens": 300, "temperature": 0,
                                         "stream": True}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line.removeprefix("data: "))
                        response_id = chunk["id"]
                        pieces.extend(choice["text"] for choice in chunk["choices"])
                return response.headers["x-trace-id"]

    def decoding() -> str | None:
        for worker_id in ("d1", "d2"):
            snapshot = loads.latest.get(worker_id)
            if snapshot is not None and snapshot.running > 0:
                return worker_id
        return None

    try:
        task = asyncio.create_task(stream())
        def pulled_and_decoding() -> bool:
            """The decode worker streams, and its pull's span is out: what a holder did for
            that pull has its parent in the trace (the worker's open spans die with it)."""
            worker = decoding()
            return len(pieces) >= 10 and worker is not None and any(
                span.name == "kv.pull" and span.service == f"tandem-worker-{worker}"
                for span in receiver.trace(client.trace_id))

        await wait_for(pulled_and_decoding, 10, "the client reading the decode worker's tokens")
        victim = decoding()
        assert victim is not None
        pull_stack.worker(victim).popen.send_signal(signal.SIGKILL)
        trace_id = await asyncio.wait_for(task, 60)
    finally:
        await bus.close()
    assert trace_id == client.trace_id and pieces
    dead = (f"tandem-worker-{victim}",)
    found = await received_trace(receiver, client, {HTTP_SPAN, "router.resume"}, dead)
    check_tree(found, client, response_id, dead_services=dead)
    generate = found.child(found.only(HTTP_SPAN), "router.generate")
    lost = found.child(generate, "router.decode", **{"tandem.worker_id": victim})
    assert lost.attributes["tandem.outcome"] != "ok"
    resume = found.child(generate, "router.resume")
    assert resume.attributes["tandem.excluded_workers"] == [victim] and resume.attributes["tandem.attempt"] == 1
    assert resume.attributes["tandem.generated_tokens"] > 0
    assert resume.attributes["tandem.request_id"] == f"{response_id}-r1"
    check_route(found, resume, candidates=2)
    survivor = "d2" if victim == "d1" else "d1"
    await wait_for(lambda: len([s for s in receiver.trace(client.trace_id) if s.name == "worker.generate"]) >= 3,
                   10, "the resumed parts' worker spans")
    found = Trace(receiver.trace(client.trace_id))
    _, resumed_prefill = part(found, resume, "router.prefill", "p1")
    _, resumed_decode = part(found, resume, "router.decode", survivor)
    assert resumed_decode.attributes["tandem.request_id"] == f"{response_id}-r1"
    # the router's log line about the loss names the trace
    router_log = Path(pull_stack.processes["router"].log_path).read_text()
    assert any("resuming" in line and f"trace_id={client.trace_id}" in line for line in router_log.splitlines())
