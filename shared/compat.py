"""The compatibility hash: two workers may exchange KV blocks only if theirs are equal.

It covers everything that changes the meaning or layout of KV bytes: model identity
(name and version), dtype, block size, KV layout (layers, KV heads, head size), engine
kind and the connector protocol version.
"""

from __future__ import annotations

import hashlib

import msgspec

CONNECTOR_PROTOCOL_VERSION = 1


class KvLayout(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    model_version: str = ""
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    engine: str
    connector_version: int = CONNECTOR_PROTOCOL_VERSION

    def compat_hash(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]

    def mismatch(self, other: "KvLayout") -> list[str]:
        """The fields that differ, for an error message a person can act on."""
        return [f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
                for name in self.__struct_fields__ if getattr(self, name) != getattr(other, name)]
