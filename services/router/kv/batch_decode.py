"""How the router decodes a worker's KV event batch for its index (`index`). Pure.

Most of a batch's bytes are its token ids (16 per block where the hashes are 2), and the
index reads them only to hash a chain a worker did not send (`index_store.store_event`) or,
in verification mode, to check the one it sent. So a batch is first decoded without them
(`KvEventBatchWithoutTokens`: msgspec skips them on the wire); it is decoded again in full
when a `BlockStored` has no usable chain (none, or not one hash per block) or when the
index verifies hashes. Either way the index ends in the same state.

A batch decoded without token ids does not have them validated: one whose token ids are
not ints is indexed all the same (the index would not read them), not dropped as malformed.

Caller: `view.KvView._on_batch`, once per message, before `KvIndex.ingest`.
"""

from __future__ import annotations

from shared.codec import Codec, MalformedCounter
from shared.schemas.kv_events import BlockStoredWithoutTokens, KvEventBatch, KvEventBatchWithoutTokens


def needs_token_ids(batch: KvEventBatchWithoutTokens) -> bool:
    """Whether the index would read token ids to ingest the batch (without verification):
    some `BlockStored` has no usable chain."""
    for event in batch.events:
        if type(event) is BlockStoredWithoutTokens:
            chain = event.chain_hashes
            if chain is None or len(chain) != len(event.block_hashes):
                return True
    return False


class KvBatchDecoder:
    """Decodes KV event batches as the index needs them (`verify_hashes`: `KvIndex.verify_hashes`);
    a malformed one is counted in `malformed` and dropped (`Codec.decode_or_none`)."""

    def __init__(self, malformed: MalformedCounter | None = None, *, verify_hashes: bool = False) -> None:
        self.malformed = malformed if malformed is not None else MalformedCounter()
        self.verify_hashes = verify_hashes
        self._without_tokens: Codec[KvEventBatchWithoutTokens] = Codec(KvEventBatchWithoutTokens, self.malformed)
        self._full: Codec[KvEventBatch] = Codec(KvEventBatch, self.malformed)

    def decode_or_none(self, data: bytes, subject: str) -> KvEventBatch | KvEventBatchWithoutTokens | None:
        if not self.verify_hashes:
            batch = self._without_tokens.decode_or_none(data, subject)
            if batch is None or not needs_token_ids(batch):
                return batch
        return self._full.decode_or_none(data, subject)
