"""Where `/v1/responses` keeps the responses it stores (`store: true`), for `GET
/v1/responses/{id}` and `previous_response_id`.

- `JetStreamResponseStore`: a NATS JetStream key-value bucket (`<namespace>_v1_responses`),
  so that any router replica finds a response another one stored. Entries expire after the
  config's TTL; the bucket holds at most `max_bytes` and drops the oldest entries past that
  (its stream discards old messages, where a plain key-value bucket would refuse new ones).
- `MemoryResponseStore`: the same bounds in this router's memory (`--responses-store memory`).

A record larger than `max_record_bytes` is not stored (logged): the response is still
answered, and retrieving it is a 404. Ids that are not a response id are never looked up.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from services.router.config import ResponsesConfig
from services.router.openai.responses_objects import StoredResponse
from shared.bus import Bus
from shared.subjects import Subjects

log = logging.getLogger(__name__)

RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")
PAYLOAD_HEADROOM = 1024  # a stored entry's headers and subject, within the server's max payload


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse) -> bool:
        """Store `stored` under its response's id; False: too large to store (logged)."""
        ...

    async def get(self, response_id: str) -> StoredResponse | None: ...


def _record(stored: StoredResponse, max_bytes: int) -> bytes | None:
    record = stored.model_dump_json(by_alias=True).encode()
    if len(record) > max_bytes:
        log.warning("response %s not stored: its record is %d bytes, more than the %d a record may hold",
                    stored.response.id, len(record), max_bytes)
        return None
    return record


class JetStreamResponseStore:
    def __init__(self, bucket: KeyValue, max_record_bytes: int) -> None:
        self._bucket = bucket
        self._max_record_bytes = max_record_bytes

    @classmethod
    async def open(cls, bus: Bus, subjects: Subjects, config: ResponsesConfig) -> JetStreamResponseStore:
        bucket = subjects.responses_bucket
        max_record = min(config.max_record_bytes, bus.client.max_payload - PAYLOAD_HEADROOM)
        try:
            return cls(await bus.js.key_value(bucket), max_record)
        except BucketNotFoundError:
            pass
        # a key-value bucket's own stream, but one that drops its oldest entries when full
        stream = StreamConfig(name=f"KV_{bucket}", subjects=[f"$KV.{bucket}.>"], max_msgs_per_subject=1,
                              max_age=config.ttl_s, max_bytes=config.max_bytes, max_msg_size=max_record + PAYLOAD_HEADROOM,
                              storage=StorageType.MEMORY, num_replicas=bus.replicas, discard=DiscardPolicy.OLD,
                              allow_rollup_hdrs=True, deny_delete=True, allow_direct=True)
        try:
            await bus.js.add_stream(stream)
        except BadRequestError:  # another router created it first: use theirs
            pass
        return cls(await bus.js.key_value(bucket), max_record)

    async def put(self, stored: StoredResponse) -> bool:
        record = _record(stored, self._max_record_bytes)
        if record is None:
            return False
        await self._bucket.put(stored.response.id, record)
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        if not RESPONSE_ID.match(response_id):
            return None
        try:
            entry = await self._bucket.get(response_id)
        except KeyNotFoundError:  # never stored, expired, or dropped for space
            return None
        return None if entry.value is None else StoredResponse.model_validate_json(entry.value)


class MemoryResponseStore:
    """The same bounds as the bucket's, in this router's memory; `clock` gives seconds."""

    def __init__(self, config: ResponsesConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # oldest first
        self._bytes = 0

    async def put(self, stored: StoredResponse) -> bool:
        record = _record(stored, self._config.max_record_bytes)
        if record is None:
            return False
        self._drop(stored.response.id)
        self._records[stored.response.id] = (self._clock(), record)
        self._bytes += len(record)
        while self._bytes > self._config.max_bytes:
            self._drop(next(iter(self._records)))
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        now = self._clock()
        while self._records and next(iter(self._records.values()))[0] + self._config.ttl_s <= now:
            self._drop(next(iter(self._records)))
        stored = self._records.get(response_id)
        return None if stored is None else StoredResponse.model_validate_json(stored[1])

    def _drop(self, response_id: str) -> None:
        dropped = self._records.pop(response_id, None)
        if dropped is not None:
            self._bytes -= len(dropped[1])
