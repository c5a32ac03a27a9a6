"""Per-request records the router publishes when a request ends (for the collector)."""

from __future__ import annotations

from shared.schemas.common import Message


class RequestRecord(Message, tag="request_record", kw_only=True):
    request_id: str
    model: str
    worker_id: str | None
    outcome: str  # "ok" or an ErrorCode value
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None
    duration_s: float
    flow: str = ""  # the routing decision's flow: "single" | "disaggregated" | "none"; "": not routed
    reason: str = ""  # the routing decision's reason (the policy's words)
    queue_s: float | None = None  # arrival to routed, in the router (waits for a worker, admission); None: not routed
