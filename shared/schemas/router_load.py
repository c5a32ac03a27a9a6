"""What one router has routed and not yet seen end, per worker: shared with the other
routers of the same cluster so that replicas behind one address do not route blind to each
other's traffic (`router.load.<router_id>`).

A `full` message is the publishing router's whole contribution (its periodic heartbeat;
an empty `workers` list is an idle router's); one that is not full carries the current
figures of the workers that changed since the last message (0 and 0: nothing there any
more). Figures are absolute, never increments: a lost or late message is corrected by the
next full one, and a receiver keeps only the newest per router (`seq`). `leaving` says the
router stops (graceful shutdown): forget it at once.

`predictions` are the prompts the router routed since its previous message, with their hash
chains: a receiver predicts their blocks on the worker as it does for its own routings, so
that a tenant's next request, whichever router takes it, follows the first one before the
worker's KV events arrive (two routers do not each place a new copy of one prefix).
"""

from __future__ import annotations

import msgspec

from shared.schemas.common import Message


class RoutedLoad(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    in_flight: int  # requests routed there and not yet ended
    prefill_tokens: int  # uncached prompt tokens of those requests not yet at their first token


class RoutedPrompt(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str  # the worker that computes the prompt
    chains: dict[int, list[int]]  # block size -> the prompt's Tandem hash chain (`shared.block_hash`)
    ttl_s: float  # how long the prediction holds without the worker's events


class RouterLoad(Message, tag="router_load", kw_only=True):
    router_id: str
    seq: int  # per router, increasing: an older message than the last one seen is dropped
    interval_s: float  # the publisher's heartbeat period: silence for a few of them means it is gone
    workers: list[RoutedLoad] = []  # full: every worker with something in flight from this router
    full: bool = True  # False: only the workers that changed since the previous message
    predictions: list[RoutedPrompt] = []
    leaving: bool = False
