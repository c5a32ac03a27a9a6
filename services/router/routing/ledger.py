"""The predicted-load ledger: what this router has routed to one worker and not yet seen end.

Pure and synchronous (no I/O, no clock). The worker pool (`services.router.fleet.worker_pool`,
the NATS adapter) keeps one `WorkerLoad` per member and calls it at each step of a
request's life on that worker:

- `route(ticket, seq)`: the request was just routed there (right after the policy's
  decision). It counts in the worker's in-flight requests, and the uncached prompt tokens
  it brings count as waiting for prefill there; a ticket that only computes a prompt for
  another worker (`Ticket.decodes` false: a pair's prefill part) counts in
  `prefill_parts` too, as a request that will not decode there;
- `first_token(ticket)`: the worker produced its first token: the prompt no longer waits;
- `finish(ticket)`: the request ended there (finished, failed, cancelled or moved on);
- `reported()`: a load snapshot of the worker arrived; it already counts what this router
  had routed there by then, so later predictions add only what changed since.

`predicted()` is how a reported figure and the ledger's counts combine into the figure the
policy weighs (`WorkerView.predicted_load`, `predicted_prefill_tokens`): a burst of requests
landing between two load reports spreads across workers instead of piling onto the one that
looked idle. Every step is idempotent and keyed by ticket identity, so a late call for a
ticket that was replaced or already ended changes nothing.
"""

from __future__ import annotations

from typing import Generic, TypeVar


def predicted(reported: int | None, ours: int, ours_at_report: int) -> int:
    """A worker's figure now: the last report, corrected by how our own share changed since."""
    if reported is None:
        return ours
    # The report already counts what we had routed when it arrived.
    return max(ours, reported + ours - ours_at_report)


class Ticket:
    """One request counted against one worker, from `WorkerLoad.route` until `finish`."""

    def __init__(self, worker_id: str, request_id: str, prefill_tokens: int = 0, *, decodes: bool = True) -> None:
        self.worker_id = worker_id
        self.request_id = request_id
        self.prefill_tokens = prefill_tokens  # uncached prompt tokens still to compute; 0 once done
        self.decodes = decodes  # False: it computes the prompt for another worker, which decodes it


TicketT = TypeVar("TicketT", bound=Ticket)


class WorkerLoad(Generic[TicketT]):
    """One worker's account: its requests in flight and the prompt tokens they still bring."""

    def __init__(self) -> None:
        self.in_flight: dict[str, TicketT] = {}  # request id -> ticket
        self.in_flight_at_report = 0  # len(in_flight) when the last load snapshot arrived
        self.outstanding_prefill_tokens = 0  # sum of `prefill_tokens` over `in_flight`
        self.outstanding_prefill_at_report = 0  # ... when the last load snapshot arrived
        self.prefill_parts = 0  # tickets in `in_flight` that will not decode here (`Ticket.decodes` false)
        self.last_routed = 0  # the routing sequence number of the latest `route` here (0: never)

    def route(self, ticket: TicketT, routed_seq: int) -> None:
        """Count `ticket`; `routed_seq` is the router's routing sequence number for this pick."""
        previous = self.in_flight.get(ticket.request_id)
        if previous is not None:  # not expected (a resumed request has a new id): keep the counts exact
            self.finish(previous)
        self.last_routed = routed_seq
        self.in_flight[ticket.request_id] = ticket
        self.outstanding_prefill_tokens += ticket.prefill_tokens
        self.prefill_parts += not ticket.decodes

    def first_token(self, ticket: TicketT) -> None:
        if self.in_flight.get(ticket.request_id) is ticket:
            self.outstanding_prefill_tokens -= ticket.prefill_tokens
        ticket.prefill_tokens = 0

    def finish(self, ticket: TicketT) -> None:
        self.first_token(ticket)
        if self.in_flight.get(ticket.request_id) is ticket:
            del self.in_flight[ticket.request_id]
            self.prefill_parts -= not ticket.decodes

    def reported(self) -> None:
        self.in_flight_at_report = len(self.in_flight)
        self.outstanding_prefill_at_report = self.outstanding_prefill_tokens
