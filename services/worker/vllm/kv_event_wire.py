"""vLLM's KV-event wire format, decoded into Tandem's KV events. Pure: no sockets.

vLLM's `ZmqEventPublisher` sends one multipart message per batch:
`(topic, seq, payload)` with `seq` an 8-byte big-endian counter from 0 and `payload` a
msgpack `KVEventBatch`: an array `[ts, events, data_parallel_rank]` whose events are maps
tagged by `"type"` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`). The structs here
mirror the fields Tandem needs (vllm/distributed/kv_events.py); unknown fields are
ignored and an unknown event type is skipped and counted, so a newer vLLM that adds
fields or event kinds does not stop the bridge.

Block hashes arrive as ints (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`:
the low 64 bits of the hash) or as raw hash bytes; both become the same 64-bit int.

The primary KV cache is vLLM's own (`medium` "GPU", which the CPU backend reports too, or
none); medium "CPU" is the host-memory tier of Tandem's connector (`connector.vllm.host_scheduler`
announces its blocks through vLLM's publisher): its stores become `BlockStored` with tier
"host" and its removals `kv_mirror.HostBlocksRemoved`. Events of other media and of extra
KV-cache groups of hybrid models (`group_idx` > 0) are skipped, so one block is never
counted twice.
"""

from __future__ import annotations

from typing import Any

import msgspec

from connector.vllm.engine_hashes import short_hash
from services.worker.vllm.kv_mirror import HostBlocksRemoved, ImageBlocksStored, MirrorEvent
from shared.block_hash import image_key
from shared.schemas.kv_events import DEVICE_TIER, HOST_TIER, AllBlocksCleared, BlockRemoved, BlockStored, KvTier

END_OF_REPLAY = -1  # the seq vLLM's replay socket sends after the last buffered batch
_TIER_OF_MEDIUM: dict[str | None, KvTier] = {None: DEVICE_TIER, "GPU": DEVICE_TIER, "CPU": HOST_TIER}
_HASH_MASK = (1 << 64) - 1

WireHash = int | bytes


class _WireBlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", kw_only=True):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    lora_name: str | None = None  # the LoRA adapter the blocks were computed with
    # per block, what else its hash took in: the LoRA name, (image identifier, offset) pairs,
    # the cache salt (vLLM's `to_event_extra_keys`); None for a block with none
    extra_keys: list[list[Any] | None] | None = None


class _WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", kw_only=True):
    block_hashes: list[WireHash]
    medium: str | None = None
    group_idx: int | None = None


class _WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # decoded one by one: an unknown kind skips one event only
    data_parallel_rank: int | None = None


_WireEvent = _WireBlockStored | _WireBlockRemoved | _WireAllBlocksCleared


class DecodedBatch(msgspec.Struct, kw_only=True):
    ts: float
    events: list[MirrorEvent]
    skipped: int  # events of unknown kinds, other tiers or other KV-cache groups


class WireDecoder:
    """Decodes batch payloads; create once, reuse (msgspec decoders are cached state)."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(_WireBatch)
        self._event = msgspec.msgpack.Decoder(_WireEvent)

    def decode(self, payload: bytes) -> DecodedBatch:
        """Raises `msgspec.DecodeError` for a payload that is not a batch at all."""
        batch = self._batch.decode(payload)
        events: list[MirrorEvent] = []
        skipped = 0
        for raw in batch.events:
            try:
                wire = self._event.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                skipped += 1
                continue
            event = _to_tandem(wire)
            if event is None:
                skipped += 1
            else:
                events.append(event)
        return DecodedBatch(ts=batch.ts, events=events, skipped=skipped)


def block_hash_int(value: WireHash) -> int:
    """vLLM's own bytes -> int conversion (`maybe_convert_block_hash`): the low 64 bits."""
    if isinstance(value, bytes):
        return short_hash(value)
    return value & _HASH_MASK


def decode_seq(seq: bytes) -> int:
    return int.from_bytes(seq, "big", signed=True)


def _to_tandem(wire: _WireEvent) -> MirrorEvent | None:
    match wire:
        case _WireAllBlocksCleared():
            return AllBlocksCleared()
        case _WireBlockStored() if (tier := _tier(wire.medium, wire.group_idx)) is not None:
            parent = None if wire.parent_block_hash is None else block_hash_int(wire.parent_block_hash)
            stored = BlockStored(block_hashes=[block_hash_int(h) for h in wire.block_hashes],
                                 parent_block_hash=parent, token_ids=wire.token_ids,
                                 block_size=wire.block_size, tier=tier, adapter=wire.lora_name or "",
                                 cache_salt=_cache_salt(wire.extra_keys, wire.lora_name) if parent is None else "")
            salts = _image_salts(wire.extra_keys)
            return ImageBlocksStored(stored=stored, salts=salts) if any(salts) else stored
        case _WireBlockRemoved() if (tier := _tier(wire.medium, wire.group_idx)) is not None:
            hashes = [block_hash_int(h) for h in wire.block_hashes]
            return BlockRemoved(block_hashes=hashes) if tier == DEVICE_TIER else HostBlocksRemoved(block_hashes=hashes)
    return None


def _image_salts(extra_keys: list[list[Any] | None] | None) -> list[bytes]:
    """Each block's images, from its extra keys' `(identifier, offset)` pairs, as
    `shared.block_hash.image_key` writes them ([] without extra keys)."""
    if not extra_keys:
        return []
    return [b"".join(image_key(key[0], key[1]) for key in keys or () if _is_image_key(key)) for keys in extra_keys]


def _cache_salt(extra_keys: list[list[Any] | None] | None, lora_name: str | None) -> str:
    """The cache salt of a chain's first block ("": none): vLLM's keys of a block come as the
    LoRA's name, the images' pairs, then the salt, the names and the salt as bare strings."""
    bare = [key for key in (extra_keys[0] or ()) if isinstance(key, str)] if extra_keys else []
    if lora_name and bare:
        bare = bare[1:]
    return bare[0] if bare else ""


def _is_image_key(key: Any) -> bool:
    return isinstance(key, (list, tuple)) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)


def _tier(medium: str | None, group_idx: int | None) -> KvTier | None:
    """The tier of the primary KV-cache group's events; None: not mirrored."""
    return _TIER_OF_MEDIUM.get(medium) if group_idx in (None, 0) else None
