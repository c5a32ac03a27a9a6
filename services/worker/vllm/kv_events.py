"""The KV-event bridge: vLLM's ZMQ publisher -> Tandem KV events buffered for the worker.

vLLM publishes from its EngineCore process (a thread there sends each batch on a PUB
socket and keeps the last `buffer_steps` batches for a ROUTER replay socket). vLLM binds
only wildcard and ipc/inproc endpoints and *connects* to `tcp://host:port`, so the
bridge picks two ipc endpoints in a private directory (`KvEventEndpoints.in_directory`):
vLLM binds both, the bridge connects — no port to pick, nothing reachable off the host.

`KvEventBridge` runs one asyncio task on the worker's loop: receive a batch, check its
sequence number, decode it (`kv_event_wire`), apply it to the mirror (`kv_mirror`), and
buffer what the mirror passes on for `take_events()`; the worker publishes those on NATS
with its own sequence numbers.

Gaps (a batch lost to a ZMQ high-water mark, or sent before the SUB socket connected):
the bridge asks vLLM's replay socket for every batch from the first missing one and
applies them in order. If the replay cannot cover the gap (replay buffer overrun, no
answer within `replay_timeout_s`), the mirror no longer matches the engine and cannot be
repaired from the engine (vLLM has no "list cached blocks" call), so the bridge emits
`AllBlocksCleared` and starts over from the next batch: routers forget this worker's
blocks and relearn them from new events. That costs cache hits for a while, never
correctness: a router never believes in a block the engine does not have.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from services.worker.vllm.kv_event_wire import END_OF_REPLAY, WireDecoder, decode_seq
from services.worker.vllm.kv_mirror import KvBlockMirror
from shared.schemas.kv_events import BlockStored, KvEvent

log = logging.getLogger(__name__)


class KvEventEndpoints(msgspec.Struct, frozen=True, kw_only=True):
    publish: str  # vLLM's PUB socket binds here
    replay: str  # vLLM's ROUTER (replay) socket binds here

    @classmethod
    def in_directory(cls, directory: str) -> KvEventEndpoints:
        # ipc paths are limited to ~107 bytes: keep the directory short (a mkdtemp in /tmp).
        return cls(publish=f"ipc://{os.path.join(directory, 'kv-events')}",
                   replay=f"ipc://{os.path.join(directory, 'kv-replay')}")

    def socket_paths(self) -> list[Path]:
        return [Path(endpoint.removeprefix("ipc://")) for endpoint in (self.publish, self.replay)
                if endpoint.startswith("ipc://")]


class BridgeCounters(msgspec.Struct, kw_only=True):
    batches: int = 0
    gaps: int = 0  # gaps seen
    replayed_batches: int = 0
    unrecoverable_gaps: int = 0  # gaps that ended in AllBlocksCleared
    skipped_events: int = 0  # other tiers, other KV groups, unknown kinds
    malformed_batches: int = 0


class KvEventBridge:
    def __init__(self, endpoints: KvEventEndpoints, *, block_size: int, topic: str = "",
                 replay_timeout_s: float = 2.0, receive_hwm: int = 100_000) -> None:
        self.endpoints = endpoints
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.receive_hwm = receive_hwm
        self.mirror = KvBlockMirror(block_size)
        self.counters = BridgeCounters()
        self._decoder = WireDecoder()
        self._context: zmq.asyncio.Context | None = None
        self._subscriber: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._next_seq = 0  # vLLM numbers batches from 0 for the life of its EngineCore
        self._buffer: list[KvEvent] = []
        self.batch_applied = asyncio.Event()  # set after each batch; tests wait on it

    @property
    def cached_blocks(self) -> int:
        return self.mirror.cached_blocks

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def start(self) -> None:
        """Connect before vLLM binds: ZMQ retries the connect, and the first batch is seq 0."""
        assert self._task is None, "the bridge was already started"
        self._context = zmq.asyncio.Context()
        self._subscriber = self._context.socket(zmq.SUB)
        self._subscriber.setsockopt(zmq.RCVHWM, self.receive_hwm)
        self._subscriber.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._subscriber.connect(self.endpoints.publish)
        self._task = asyncio.create_task(self._run(), name="vllm-kv-event-bridge")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._subscriber is not None:
            self._subscriber.close(linger=0)
        if self._context is not None:
            self._context.term()

    def take_events(self) -> list[KvEvent]:
        events, self._buffer = self._buffer, []
        return events

    def snapshot(self) -> list[BlockStored]:
        return self.mirror.snapshot()

    # ---- internals -------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._subscriber is not None
        while True:
            frames = await self._subscriber.recv_multipart()
            try:
                await self._on_frames(frames)
            except Exception:  # a bug in decoding must not end the bridge silently
                log.exception("KV event bridge failed on a batch; resynchronising")
                self._lose_sync()

    async def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.counters.malformed_batches += 1
            return
        _topic, seq_bytes, payload = frames
        seq = decode_seq(seq_bytes)
        if seq < self._next_seq:
            if seq == 0:  # a new publisher (EngineCore restarted): nothing we hold is valid
                log.warning("vLLM KV event sequence restarted at 0 (expected %d)", self._next_seq)
                self._lose_sync()
            else:
                return  # already applied (a replay overlapped the live stream)
        elif seq > self._next_seq:
            self.counters.gaps += 1
            log.warning("vLLM KV events %d..%d missing; asking for a replay", self._next_seq, seq - 1)
            if not await self._replay(until=seq):
                self.counters.unrecoverable_gaps += 1
                log.warning("vLLM could not replay KV events from %d; announcing a cleared cache",
                            self._next_seq)
                self._lose_sync()
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counters.malformed_batches += 1
            log.warning("undecodable vLLM KV event batch %d; resynchronising", seq)
            self._lose_sync()
        else:
            self.counters.skipped_events += batch.skipped
            for event in batch.events:
                self._buffer.extend(self.mirror.apply(event))
        self.counters.batches += 1
        self._next_seq = seq + 1
        self.batch_applied.set()

    def _lose_sync(self) -> None:
        self._buffer.append(self.mirror.clear())

    async def _replay(self, *, until: int) -> bool:
        """Apply the missing batches [next_seq, until) from vLLM's replay socket."""
        assert self._context is not None
        # A fresh DEALER per replay: a late answer to an earlier, timed-out request can
        # never be mistaken for this one.
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.endpoints.replay)
        try:
            await dealer.send_multipart([b"", self._next_seq.to_bytes(8, "big")])
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    _empty, _topic, seq_bytes, payload = await dealer.recv_multipart()
                    seq = decode_seq(seq_bytes)
                    if seq == END_OF_REPLAY:
                        return self._next_seq >= until
                    if seq < self._next_seq:
                        continue
                    if seq > self._next_seq:
                        return False  # the replay buffer no longer holds the first missing batch
                    self._apply(seq, payload)
                    self.counters.replayed_batches += 1
        except (TimeoutError, ValueError):  # ValueError: a reply with the wrong frame count
            return False
        finally:
            dealer.close(linger=0)
