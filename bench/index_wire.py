"""What the router pays for a KV event batch before `KvIndex.ingest`, for `bench.index`: the
bytes a worker publishes (`published`), and decoding them per block (`wire_costs`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from bench.index_workload import Chunk, Snapshot
from services.router.kv.batch_decode import KvBatchDecoder
from shared.codec import encode
from shared.schemas.kv_events import KvEventBatch, for_wire


def timed(action: Callable[[], object]) -> tuple[float, float, float]:
    """(wall, CPU, calling thread's CPU) seconds of one call. The process's CPU counts every
    thread: Dynamo's `apply_event` hands part of its work to threads of its own."""
    cpu, wall, thread = time.process_time(), time.perf_counter(), time.thread_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - thread


def published(batch: KvEventBatch) -> bytes:
    """The batch's bytes as a worker publishes them (`services.worker.event_streams`: token ids packed)."""
    return encode(msgspec.structs.replace(batch, events=for_wire(batch.events)))


def wire_costs(chunk: Chunk, payloads: list[bytes], block_size: int) -> dict:
    """What the router's adapter pays before `ingest`, per block: decoding with its decoder
    (`KvBatchDecoder`), and (`full_decode_`) decoding every field, token ids included; with
    the token ids packed as workers send them, unpacked as workers sent them before, and none."""
    decoders = {"": KvBatchDecoder().decode_or_none,
                "full_": lambda payload, _subject, decode=msgspec.msgpack.Decoder(KvEventBatch).decode: decode(payload)}
    batches, blocks = chunk.batches, chunk.blocks
    unpacked = [encode(batch) for batch in batches]
    without = [encode(msgspec.structs.replace(batch, events=[
        msgspec.structs.replace(event, token_ids=[]) for event in batch.events])) for batch in batches]
    sample = Snapshot("resync", 100_000, block_size, 0)
    row = {}
    for name, sent, token_ids, packed in (("with_token_ids", payloads, True, True),
                                          ("with_unpacked_token_ids", unpacked, True, False),
                                          ("chain_hashes_only", without, False, False)):
        batch = sample.batch(seq=1, token_ids=token_ids)
        snapshot = encode(msgspec.structs.replace(batch, events=for_wire(batch.events)) if packed else batch)
        row[f"event_bytes_per_block_{name}"] = round(sum(map(len, sent)) / blocks, 1)
        row[f"snapshot_bytes_per_block_{name}"] = round(len(snapshot) / sample.blocks, 1)
        for prefix, decode in decoders.items():
            cpu = timed(lambda sent=sent, decode=decode: [decode(payload, "bench") for payload in sent])[1]
            row[f"{prefix}decode_ns_per_block_{name}"] = round(cpu / blocks * 1e9)
            cpu = timed(lambda snapshot=snapshot, decode=decode: decode(snapshot, "bench"))[1]
            row[f"{prefix}snapshot_decode_ns_per_block_{name}"] = round(cpu / sample.blocks * 1e9)
    return row
