"""What a request's KV hand-off left for it on the reader's side (`Prepared`): the pins to
drop after its first output and the counts of its transfer record.

Written by `DataPlane.prepare()` and `DataPlane.await_push()` (`connector.dataplane`), filled
by a pull (`connector.pull`) or a push's receipt (`connector.push_receipt`); the worker's
`connector.kv_session.KvSession` hands it back to `release_pins()`. Pure data: it sits below
the data plane's contract so that both ends of a transfer can name it.
"""

from __future__ import annotations

import msgspec


class Prepared(msgspec.Struct, kw_only=True):
    """What `prepare()` left for the request: pins to drop after its first output, counts,
    and (vLLM) the request id of an order staged with the engine until it takes it."""

    pinned_block_ids: list[int] = []
    pulled_tokens: int = 0
    recomputed_tokens: int = 0
    retried_blocks: int = 0  # blocks read again after a failure (`connector.retry`)
    recovered_blocks: int = 0  # of those, blocks that then arrived and verified
    recomputed_blocks: int = 0  # blocks meant to arrive that were computed
    staged_request_id: str = ""
