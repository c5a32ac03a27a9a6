"""One round of the index benchmark, for `bench.index` (whose docstring says what each part
times and why), on a workload built once per fleet size (`build_workload`). `ingest_round`,
`match_round` and `resync_round`, in that order, take the round's fresh `KvIndex` (`new_index`:
as the router builds it) and Dynamo's `RadixTree` (None: Tandem's figures only);
`decode_round` times the router's decoding alone; each returns its part of the round's row.
`verify_ingest_s` times ingest with the chains recomputed, once per fleet size.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.index_wire import published, timed
from bench.index_workload import Chunk, Fleet, Snapshot
from services.router.kv.batch_decode import KvBatchDecoder
from services.router.kv.index import KvIndex, block_hashes_for
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, KvEventBatch, KvEventBatchWithoutTokens


def _ms(seconds_or_ns: float, *, ns: bool = False) -> float:
    return round(seconds_or_ns / (1e6 if ns else 1e-3), 4)


@dataclass
class Workload:
    fleet: Fleet
    chunks: list[Chunk]
    query_chains: list[list[int]]
    snapshot: Snapshot
    snapshot_changed: Snapshot
    blocks: int
    events: int
    payloads: list[list[bytes]]  # each chunk's batches as workers publish them, token ids included
    router_batches: list[list[KvEventBatch | KvEventBatchWithoutTokens]]  # as the router decodes them


def build_workload(workers: int, total_blocks: int, prompt_tokens: int, block_size: int, queries: int,
                   seed: int, resync_blocks: int) -> Workload:
    fleet = Fleet(workers, block_size, prompt_tokens, seed)
    chunks = list(fleet.chunks(total_blocks))
    query_chains = [block_hashes_for(fleet.query(), block_size) for _ in range(queries)]
    snapshot = Snapshot("resync", resync_blocks, block_size, seed + 1)
    payloads = [[published(batch) for batch in chunk.batches] for chunk in chunks]
    return Workload(fleet, chunks, query_chains, snapshot, snapshot.changed(),
                    blocks=sum(chunk.blocks for chunk in chunks), events=sum(len(chunk.batches) for chunk in chunks),
                    payloads=payloads, router_batches=[_router_decoded(each) for each in payloads])


def _router_decoded(payloads: list[bytes]) -> list[KvEventBatch | KvEventBatchWithoutTokens]:
    decode = KvBatchDecoder().decode_or_none
    batches = [decode(payload, "bench") for payload in payloads]
    assert all(batches), "the workload's batches decode"
    return batches  # type: ignore[return-value]


def new_index(workload: Workload, *, verify_hashes: bool = False) -> KvIndex:
    index = KvIndex(verify_hashes=verify_hashes, trust_chains=True)  # as the router builds it (services.router.kv.model_kv)
    for name in workload.fleet.names:
        index.add_worker(name, workload.fleet.block_size)
    return index


def ingest_round(workload: Workload, index: KvIndex, tree) -> dict:
    """The events into `index` (decoded beforehand: ingest alone), into a second index as the
    router takes them (each batch decoded from the bytes a worker publishes, then ingested),
    and into `tree`, chunk by chunk, taking turns going first."""
    wire_index = new_index(workload)
    decode = KvBatchDecoder().decode_or_none
    wall = {"tandem": 0.0, "wire": 0.0, "dynamo": 0.0}
    cpu = dict(wall)
    thread_cpu = dict(wall)
    load_before = os.getloadavg()[0]
    chunk_ratios: list[float] = []
    for number, chunk in enumerate(workload.chunks):
        ingest, wire_ingest = index.ingest, wire_index.ingest
        apply_event = tree.apply_event if tree is not None else None

        def tandem(batches=workload.router_batches[number]) -> None:
            for batch in batches:
                ingest(batch)

        def wire(payloads=workload.payloads[number]) -> None:
            for payload in payloads:  # as `view.KvView._on_batch` does
                batch = decode(payload, "bench")
                if batch is not None:
                    wire_ingest(batch)

        def dynamo(events=chunk.dynamo_events) -> None:
            for worker, event in events:
                apply_event(worker, event)

        actions = {"tandem": tandem, "wire": wire} | ({"dynamo": dynamo} if tree is not None else {})
        names = list(actions)
        times = {}
        for name in names[number % len(names):] + names[:number % len(names)]:
            times[name] = timed(actions[name])
        for name, (wall_s, cpu_s, thread_s) in times.items():
            wall[name] += wall_s
            cpu[name] += cpu_s
            thread_cpu[name] += thread_s
        if tree is not None:
            chunk_ratios.append(times["dynamo"][0] / times["tandem"][0])
    for each in (index, wire_index):
        stats = each.stats()
        assert sum(stats.blocks_per_worker.values()) == workload.blocks, "every announced block is indexed"
        assert not stats.unsynced_workers
    assert index.stats() == wire_index.stats(), "decoding from the wire indexes the same blocks"
    return _ingest_row(workload.blocks, wall, cpu, thread_cpu, chunk_ratios, load_before, dynamo=tree is not None)


def _ingest_row(blocks: int, wall: dict, cpu: dict, thread_cpu: dict, chunk_ratios: list[float],
                load_before: float, *, dynamo: bool) -> dict:
    """A round's ingest figures from its summed times (per system: wall, CPU, calling thread's CPU)."""
    row = {"tandem_ingest_blocks_per_s": round(blocks / wall["tandem"]),
           "tandem_ingest_blocks_per_cpu_s": round(blocks / cpu["tandem"]),
           "tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids": round(blocks / cpu["wire"]),
           "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    if dynamo:
        row |= {"dynamo_ingest_blocks_per_s": round(blocks / wall["dynamo"]),
                "dynamo_ingest_blocks_per_cpu_s": round(blocks / cpu["dynamo"]),
                "ingest_ratio": round(wall["dynamo"] / wall["tandem"], 3),
                "ingest_ratio_cpu": round(cpu["dynamo"] / cpu["tandem"], 3),
                "decode_and_ingest_ratio_cpu_with_token_ids": round(cpu["dynamo"] / cpu["wire"], 3),
                # Dynamo's calling thread alone: its share of the work without the threads it hands to
                "dynamo_ingest_blocks_per_calling_thread_cpu_s": round(blocks / thread_cpu["dynamo"]),
                "dynamo_other_threads_cpu_share": round(1 - thread_cpu["dynamo"] / cpu["dynamo"], 3),
                "decode_and_ingest_ratio_to_dynamo_calling_thread": round(thread_cpu["dynamo"] / cpu["wire"], 3),
                "chunk_ratio_min": round(min(chunk_ratios), 3),
                "chunk_ratio_median": round(statistics.median(chunk_ratios), 3)}
    return row


def match_round(workload: Workload, index: KvIndex, tree) -> dict:
    tandem_ns: list[int] = []
    dynamo_ns: list[int] = []
    disagree_best = disagree_any = 0
    names = workload.fleet.names
    match = index.match
    for number, chain in enumerate(workload.query_chains):
        for impl in ("tandem", "dynamo") if number % 2 else ("dynamo", "tandem"):
            if impl == "tandem":
                started = time.perf_counter_ns()
                overlaps = match(chain)
                tandem_ns.append(time.perf_counter_ns() - started)
            elif tree is not None:
                started = time.perf_counter_ns()
                scores = tree.find_matches(chain).scores
                dynamo_ns.append(time.perf_counter_ns() - started)
        if tree is not None:
            theirs = {names[worker]: score for (worker, _dp_rank), score in scores.items()}
            disagree_best += max(overlaps.values(), default=0) != max(theirs.values(), default=0)
            disagree_any += overlaps != theirs
    if disagree_best or disagree_any:
        print(f"bench_index: WARNING workers={workload.fleet.workers}: Tandem and Dynamo disagree on the best "
              f"overlap for {disagree_best} and on some worker's for {disagree_any} of {len(workload.query_chains)} "
              f"queries", file=sys.stderr)
    row = {"tandem_match_p50_ms": _ms(float(np.percentile(tandem_ns, 50)), ns=True),
           "tandem_match_p99_ms": _ms(float(np.percentile(tandem_ns, 99)), ns=True),
           "tandem_open_workers": len(index.open_workers())}  # scanned linearly, not bisected
    if tree is not None:
        row |= {"dynamo_match_p50_ms": _ms(float(np.percentile(dynamo_ns, 50)), ns=True),
                "dynamo_match_p99_ms": _ms(float(np.percentile(dynamo_ns, 99)), ns=True),
                "queries_disagreeing": disagree_any}
    return row


def resync_round(workload: Workload, index: KvIndex, tree) -> dict:
    """A worker of `snapshot.blocks` blocks joins the loaded index and resyncs (see `bench.index`)."""
    snapshot, changed = workload.snapshot, workload.snapshot_changed
    block_size = workload.fleet.block_size
    index.add_worker(snapshot.worker_id, block_size)
    cold_batch, gap_batch = snapshot.batch(seq=1), changed.batch(seq=9)
    stepwise_batch = KvEventBatch(worker_id=snapshot.worker_id, seq=17, ts=0.0,  # not a leading clear: no bulk swap
                                  events=[BlockRemoved(block_hashes=[]), AllBlocksCleared(), *changed.events()])
    cold = timed(lambda: index.ingest(cold_batch))[0]
    gap = timed(lambda: index.ingest(gap_batch))[0]
    assert index.stats().blocks_per_worker[snapshot.worker_id] == changed.blocks
    stepwise = timed(lambda: index.ingest(stepwise_batch))[0]
    assert index.stats().blocks_per_worker[snapshot.worker_id] == changed.blocks
    removal = timed(lambda: index.remove_worker(snapshot.worker_id))[0]
    assert sum(index.stats().blocks_per_worker.values()) == workload.blocks
    row = {"resync_blocks": changed.blocks, "tandem_resync_cold_s": round(cold, 4),
           "tandem_resync_after_gap_s": round(gap, 4), "tandem_resync_event_by_event_s": round(stepwise, 4),
           "tandem_remove_worker_s": round(removal, 4)}
    if tree is not None:
        worker = workload.fleet.workers  # a worker id the fleet does not use
        cold_events, gap_events = snapshot.dynamo_events(), changed.dynamo_events()

        def dynamo_resync(events: list[bytes]) -> None:
            tree.clear_all_blocks(worker)
            for event in events:
                tree.apply_event(worker, event)

        row |= {"dynamo_resync_cold_s": round(timed(lambda: dynamo_resync(cold_events))[0], 4),
                "dynamo_resync_after_gap_s": round(timed(lambda: dynamo_resync(gap_events))[0], 4),
                "dynamo_remove_worker_s": round(timed(lambda: tree.remove_worker(worker))[0], 4)}
    return row


def verify_ingest_s(workload: Workload) -> float:
    """Wall seconds to ingest the events with verification (chains recomputed from token ids)."""
    index = new_index(workload, verify_hashes=True)
    wall = timed(lambda: [index.ingest(batch) for chunk in workload.chunks for batch in chunk.batches])[0]
    assert index.stats().mismatched_blocks == 0, "the workload's chain hashes are Tandem's"
    return wall


def decode_round(workload: Workload, ingest_row: dict) -> dict:
    """The router's decoding of every batch alone (token ids sent, packed), per CPU second;
    with this round's ingest alone, their sum (`_summed`: how runs before measured decode plus
    ingest, `ingest_round` now times the two together) and its ratio to Dynamo's `apply_event`."""
    decode = KvBatchDecoder().decode_or_none
    cpu = timed(lambda: [decode(payload, "bench") for payloads in workload.payloads for payload in payloads])[1]
    seconds_per_block = 1 / ingest_row["tandem_ingest_blocks_per_cpu_s"] + cpu / workload.blocks
    row = {"tandem_decode_ns_per_block_with_token_ids": round(cpu / workload.blocks * 1e9),
           "tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids_summed": round(1 / seconds_per_block)}
    if "dynamo_ingest_blocks_per_cpu_s" in ingest_row:
        row["decode_and_ingest_ratio_cpu_with_token_ids_summed"] = round(
            1 / seconds_per_block / ingest_row["dynamo_ingest_blocks_per_cpu_s"], 3)
    return row
