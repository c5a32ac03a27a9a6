"""msgpack framing for bus messages, with one typed decoder per stream.

`Codec.decode_or_none` is what subscribers use: a malformed message is counted, logged
once per subject, dropped, and the service keeps running. Malformed is anything that does
not decode to the stream's type: bad msgpack, a wrong shape, a newer schema version, and
nesting too deep for the decoder (a nesting bomb's `RecursionError` becomes a
`msgspec.DecodeError`, so `decode()` callers catch one kind of error).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Generic, TypeVar

import msgspec

from shared.schemas.common import SCHEMA_VERSION

T = TypeVar("T")
log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


class MalformedCounter:
    """Counts dropped messages per subject; logs the first one of each subject."""

    def __init__(self) -> None:
        self.by_subject: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_subject.values())

    def record(self, subject: str, error: Exception) -> None:
        self.by_subject[subject] += 1
        if self.by_subject[subject] == 1:
            log.warning("dropping malformed message on %s: %s (further ones counted)", subject, error)


class Codec(Generic[T]):
    def __init__(self, message_type: Any, malformed: MalformedCounter | None = None) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self.malformed = malformed if malformed is not None else MalformedCounter()

    def decode(self, data: bytes) -> T:
        try:
            message = self._decoder.decode(data)
        except RecursionError:
            raise msgspec.DecodeError("the message nests too deeply") from None
        version = getattr(message, "v", SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise msgspec.ValidationError(f"schema version {version} is newer than {SCHEMA_VERSION}")
        return message

    def decode_or_none(self, data: bytes, subject: str) -> T | None:
        try:
            return self.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            self.malformed.record(subject, error)
            return None
