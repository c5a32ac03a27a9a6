"""The admission gate (the adapter around the admission policy), on an event loop with plain
worker views and no network: who waits, who starts when a request leaves, who is refused
(429 with `Retry-After`), and a client that leaves while waiting."""

from __future__ import annotations

import asyncio

import pytest

from services.router.config import AdmissionConfig
from services.router.flows.admission import AdmissionGate
from services.router.flows.records import GenerationParams, TokenUsage
from services.router.openai.errors import TooManyRequests, error_info
from services.router.routing import WorkerView
from services.router.routing.admission import Tenant
from shared.schemas import SamplingParams
from shared.schemas.membership import WorkerRole, WorkerStatus
from tests.waiting import wait_for

MODEL = "tiny"


def worker(max_num_seqs: int) -> WorkerView:
    return WorkerView(worker_id="w", model=MODEL, role=WorkerRole.BOTH, status=WorkerStatus.ACTIVE,
                      max_num_seqs=max_num_seqs, max_model_len=4096, reported_load=0, in_flight=0,
                      in_flight_at_report=0, last_routed=0, compat_hash="h")


def request(name: str, tenant: Tenant = Tenant(), max_tokens: int = 8) -> GenerationParams:
    return GenerationParams(request_id=name, endpoint="completions", model=MODEL, arrived_at=0.0,
                            prompt_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=max_tokens), stop=(),
                            tenant=tenant)


def gate(slots: int = 1, **config) -> AdmissionGate:
    views = [worker(slots)] if slots else []
    return AdmissionGate(AdmissionConfig(slots_per_seq=1.0 if slots else 0.0, **config), lambda: views,
                         lambda: 0.0, retry_after=3)


async def test_with_the_queue_off_every_request_passes_at_once() -> None:
    admission = AdmissionGate(AdmissionConfig(), lambda: [worker(1)], lambda: 0.0, retry_after=1)
    tickets = [await admission.enter(request(f"r{i}")) for i in range(5)]
    assert all(ticket.ask is None for ticket in tickets) and admission.waiting() == 0


async def test_a_waiting_request_starts_when_one_leaves_the_most_urgent_first() -> None:
    admission = gate(slots=1)
    first = await admission.enter(request("first"))
    low = asyncio.create_task(admission.enter(request("low", Tenant(priority=2))))
    urgent = asyncio.create_task(admission.enter(request("urgent", Tenant(priority=-1))))
    await wait_for(lambda: admission.waiting() == 2)
    admission.leave(first, TokenUsage(4, 8, 0))
    started = await urgent
    assert started.ask.request_id == "urgent" and not low.done()
    admission.leave(started, TokenUsage(4, 8, 0))
    assert (await low).ask.request_id == "low"


async def test_a_sheddable_request_is_refused_with_retry_after_when_no_slot_is_free() -> None:
    admission = gate(slots=1, sheddable_priority=5)
    await admission.enter(request("running"))
    with pytest.raises(TooManyRequests) as refused:
        await admission.enter(request("batch", Tenant(priority=5)))
    assert refused.value.retry_after_s == 3 and refused.value.http_status == 429


async def test_a_waiting_request_shed_for_a_more_urgent_one_gets_429() -> None:
    admission = gate(slots=1, max_queued=1)
    await admission.enter(request("running"))
    low = asyncio.create_task(admission.enter(request("low", Tenant(priority=1))))
    await wait_for(lambda: admission.waiting() == 1)
    urgent = asyncio.create_task(admission.enter(request("urgent", Tenant(priority=0))))
    with pytest.raises(TooManyRequests):
        await low
    assert not urgent.done() and admission.waiting() == 1
    urgent.cancel()


async def test_a_client_that_leaves_while_waiting_leaves_the_queue() -> None:
    admission = gate(slots=1)
    running = await admission.enter(request("running"))
    waiting = asyncio.create_task(admission.enter(request("waiting")))
    await wait_for(lambda: admission.waiting() == 1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert admission.waiting() == 0
    admission.leave(running, TokenUsage(4, 8, 0))
    assert (await admission.enter(request("next"))).ask.request_id == "next"  # the slot is free


async def test_a_request_that_waits_past_the_limit_is_refused() -> None:
    admission = gate(slots=1, max_wait_s=0.01)
    await admission.enter(request("running"))
    with pytest.raises(TooManyRequests):
        await admission.enter(request("waiting"))
    assert admission.waiting() == 0


async def test_a_key_past_its_tokens_per_minute_is_refused_as_rate_limited() -> None:
    admission = gate(slots=0)
    tenant = Tenant(key="k", tokens_per_minute=12)
    ticket = await admission.enter(request("first", tenant))  # 12 estimated: the minute's budget
    with pytest.raises(TooManyRequests) as refused:
        await admission.enter(request("second", tenant))
    assert error_info(refused.value).code == "rate_limited" and refused.value.retry_after_s == 5  # 1 token / 5 s
    admission.leave(ticket, TokenUsage(4, 2, 0))  # it used 6 of the 12
    await admission.enter(request("third", tenant))


# --- the caller: headers and the API key


def test_the_caller_reads_the_priority_header_and_its_key_s_default_weight_and_top() -> None:
    from services.router.http.caller import API_KEY_SCOPE, caller_of
    from shared.api_keys import ApiKey

    key = ApiKey(name="team", sha256="0" * 64, priority=3, top_priority=-1, weight=2.0, tpm=600)
    scope = {"headers": [(b"x-tandem-priority", b"-5"), (b"x-tandem-worker", b"w1")], API_KEY_SCOPE: key}
    caller = caller_of(scope)
    assert caller.route_hint == "w1" and caller.priority == -5
    assert caller.tenant(None) == Tenant(key="team", weight=2.0, priority=-1, tokens_per_minute=600)  # its top
    assert caller.tenant(7).priority == 7  # the body's field wins over the header
    assert caller_of({"headers": [], API_KEY_SCOPE: key}).tenant(None).priority == 3  # the key's default
    assert caller_of({"headers": []}).tenant(None) == Tenant()


def test_a_malformed_priority_header_is_a_400_naming_it() -> None:
    from services.router.http.caller import caller_of
    from services.router.openai.errors import BadRequest

    for value in (b"high", b"1e3", str(2**40).encode()):
        with pytest.raises(BadRequest) as refused:
            caller_of({"headers": [(b"x-tandem-priority", value)]})
        assert refused.value.param == "x-tandem-priority"
