"""The predicted-load ledger on plain data: a request counts from route to finish, its
uncached prompt tokens until its first token, a load report records what it covers, and
late or repeated calls change nothing."""

from __future__ import annotations

from services.router.routing.ledger import Ticket, WorkerLoad, predicted


def counts(ledger: WorkerLoad) -> tuple[int, int]:
    return len(ledger.in_flight), ledger.outstanding_prefill_tokens


def test_route_first_token_finish() -> None:
    ledger: WorkerLoad[Ticket] = WorkerLoad()
    first, second = Ticket("w1", "r1", prefill_tokens=300), Ticket("w1", "r2", prefill_tokens=200)
    ledger.route(first, routed_seq=1)
    ledger.route(second, routed_seq=2)
    assert counts(ledger) == (2, 500) and ledger.last_routed == 2
    ledger.first_token(first)
    ledger.first_token(first)  # idempotent
    assert counts(ledger) == (2, 200) and first.prefill_tokens == 0
    ledger.finish(second)  # ended before its first token (failed, cancelled): its tokens go too
    ledger.finish(first)
    ledger.finish(first)  # idempotent
    assert counts(ledger) == (0, 0)


def test_a_replaced_ticket_no_longer_counts() -> None:
    ledger: WorkerLoad[Ticket] = WorkerLoad()
    old, new = Ticket("w1", "r1", prefill_tokens=100), Ticket("w1", "r1", prefill_tokens=40)
    ledger.route(old, routed_seq=1)
    ledger.route(new, routed_seq=2)  # same request id: the old ticket is finished first
    assert counts(ledger) == (1, 40)
    ledger.finish(old)  # a late call for the replaced ticket
    assert counts(ledger) == (1, 40)
    ledger.finish(new)
    assert counts(ledger) == (0, 0)


def test_a_pair_prefill_part_counts_as_a_request_that_will_not_decode_there() -> None:
    ledger: WorkerLoad[Ticket] = WorkerLoad()
    part, whole = Ticket("w1", "r1", 1000, decodes=False), Ticket("w1", "r2", 1000)
    ledger.route(part, routed_seq=1)
    ledger.route(whole, routed_seq=2)
    assert (len(ledger.in_flight), ledger.prefill_parts) == (2, 1)
    ledger.route(Ticket("w1", "r1", 500), routed_seq=3)  # r1 again, now to decode here: the part is replaced
    assert (len(ledger.in_flight), ledger.prefill_parts) == (2, 0)
    ledger.finish(part)  # a late call for the replaced part
    assert ledger.prefill_parts == 0
    again = Ticket("w1", "r3", 1000, decodes=False)
    ledger.route(again, routed_seq=4)
    ledger.first_token(again)  # its prompt is done; it still counts until it ends
    assert ledger.prefill_parts == 1
    ledger.finish(again)
    ledger.finish(again)  # idempotent
    assert (len(ledger.in_flight), ledger.prefill_parts) == (2, 0)


def test_a_report_records_the_counts_it_covers() -> None:
    ledger: WorkerLoad[Ticket] = WorkerLoad()
    ticket = Ticket("w1", "r1", prefill_tokens=300)
    ledger.route(ticket, routed_seq=1)
    ledger.reported()
    assert (ledger.in_flight_at_report, ledger.outstanding_prefill_at_report) == (1, 300)
    ledger.route(Ticket("w1", "r2", prefill_tokens=50), routed_seq=2)
    # a report of 1000 pending tokens (other routers' work too) already counted our 300
    assert predicted(1000, ledger.outstanding_prefill_tokens, ledger.outstanding_prefill_at_report) == 1050
    ledger.first_token(ticket)
    assert predicted(1000, ledger.outstanding_prefill_tokens, ledger.outstanding_prefill_at_report) == 750


def test_predictions_never_fall_below_what_we_know() -> None:
    assert predicted(None, 2, 0) == 2  # no report yet
    assert predicted(2, 5, 0) == 7  # routed 5 since a report of 2
    assert predicted(4, 1, 3) == 2  # 2 of ours ended since
    assert predicted(0, 2, 2) == 2  # the report is older than ours
