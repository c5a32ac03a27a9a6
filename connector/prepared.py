"""What a request's KV hand-off left for it on the reader's side (`Prepared`): the pins to
drop after its first output and the counts of its transfer record.

Written by `DataPlane.prepare()` and `DataPlane.await_push()` (`connector.dataplane`), filled
by a pull (`connector.pull`) or a push's receipt (`connector.push_receipt`); the worker's
`connector.kv_session.KvSession` hands it back to `release_pins()`. `TransferTotals` adds
every request's counts up for the worker's load snapshot. Pure data: it sits below the data
plane's contract so that both ends of a transfer can name it.
"""

from __future__ import annotations

import msgspec


class TransferCounts(msgspec.Struct, kw_only=True):
    """What a hand-off brought in: tokens received and tokens computed instead, blocks read
    again after a failure (`connector.retry`), of those the ones that then arrived and
    verified, and blocks meant to arrive that were computed."""

    pulled_tokens: int = 0
    recomputed_tokens: int = 0
    retried_blocks: int = 0
    recovered_blocks: int = 0
    recomputed_blocks: int = 0


class Prepared(TransferCounts, kw_only=True):
    """What `prepare()` left for the request: pins to drop after its first output, its
    counts, and (vLLM) the request id of an order staged with the engine until it takes it."""

    pinned_block_ids: list[int] = []
    staged_request_id: str = ""


class TransferTotals(TransferCounts, kw_only=True):
    """A data plane's counts since it started, every request's summed (`count`): the worker's
    load snapshot reports them as its `kv_*_total` fields."""

    def count(self, prepared: Prepared) -> None:
        for name in TransferCounts.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(prepared, name))
