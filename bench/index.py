"""Index benchmark: Tandem's `KvIndex` beside NVIDIA Dynamo's `RadixTree`, same events.

The workload (`bench.index_workload`): a simulated fleet's KV events, with Tandem's chain
hashes in every `BlockStored` as workers send them (Dynamo is handed the same hashes).
Tandem's index is built as the router builds it (`trust_chains`: `match` bisects chains).

Per fleet size the events and queries are built once; then each round, on a fresh
`KvIndex` and a fresh `RadixTree`:
- ingest: the events, chunk by chunk (50k blocks), taking turns going first: Tandem's
  index given the batches decoded beforehand (ingest alone), a second one given the bytes a
  worker publishes, each batch decoded as the router decodes it then ingested (decode plus
  ingest: the router's whole path), and Dynamo's `apply_event`, which parses its JSON itself;
- match: `match` / `find_matches` on the same 8k-token query chains, alternating (both
  must agree on every worker's overlap: a warning on stderr if not);
- resync: a worker holding 1M blocks answers a snapshot request. Tandem: its snapshot
  batch ingested cold (the worker was empty), after a gap (1% of its chains changed: the
  bulk swap), and the same snapshot applied event by event; Dynamo: `clear_all_blocks`
  and the snapshot's events; then the worker's removal.
The router decodes a batch without the token ids where the index does not read them
(`KvBatchDecoder`); workers send them packed (`kv_events.for_wire`), as the payloads here
are. Each round also times the decoding alone, of every batch (`_summed`: decode alone
plus ingest alone, as runs before measured decode plus ingest).
Rates are per wall second (and per CPU second of the process); the ratios are Tandem's
rates over Dynamo's, per round; the summary gives medians and spreads (min, max) over the
rounds. The box may be shared and noisy: compare within a round.

The garbage collector is frozen once the events are built: a collection that walks
millions of pre-built event objects would land in whichever index happens to be timed,
and a router holds no such backlog (it decodes a batch and drops it).

    python -m bench.index [--quick] [--workers 16,256,1024] [--blocks N] [--rounds R] [--out FILE]

prints one JSON document on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.index_wire import published, timed, wire_costs
from bench.index_workload import Chunk, Fleet, Snapshot
from services.router.kv.batch_decode import KvBatchDecoder
from services.router.kv.index import KvIndex, block_hashes_for
from shared.schemas.kv_events import AllBlocksCleared, BlockRemoved, KvEventBatch, KvEventBatchWithoutTokens

INGEST_RATIO_GOAL = 1.1
DECODE_AND_INGEST_RATIO_GOAL = 1.5  # Tandem's decode + ingest per CPU second over Dynamo's, token ids sent


def _load_radix_tree() -> type | None:
    try:
        from dynamo.llm import RadixTree
    except Exception as error:  # any import failure means: no Dynamo figures, and say why
        print(f"bench_index: no Dynamo figures: cannot import RadixTree from dynamo.llm "
              f"(PyPI ai-dynamo-runtime): {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return RadixTree


def _ms(seconds_or_ns: float, *, ns: bool = False) -> float:
    return round(seconds_or_ns / (1e6 if ns else 1e-3), 4)


@dataclass
class _Workload:
    fleet: Fleet
    chunks: list[Chunk]
    query_chains: list[list[int]]
    snapshot: Snapshot
    snapshot_changed: Snapshot
    blocks: int
    events: int
    payloads: list[list[bytes]]  # each chunk's batches as workers publish them, token ids included
    router_batches: list[list[KvEventBatch | KvEventBatchWithoutTokens]]  # as the router decodes them


def _build(workers: int, total_blocks: int, prompt_tokens: int, block_size: int, queries: int, seed: int,
           resync_blocks: int) -> _Workload:
    fleet = Fleet(workers, block_size, prompt_tokens, seed)
    chunks = list(fleet.chunks(total_blocks))
    query_chains = [block_hashes_for(fleet.query(), block_size) for _ in range(queries)]
    snapshot = Snapshot("resync", resync_blocks, block_size, seed + 1)
    payloads = [[published(batch) for batch in chunk.batches] for chunk in chunks]
    return _Workload(fleet, chunks, query_chains, snapshot, snapshot.changed(),
                     blocks=sum(chunk.blocks for chunk in chunks), events=sum(len(chunk.batches) for chunk in chunks),
                     payloads=payloads, router_batches=[_router_decoded(each) for each in payloads])


def _router_decoded(payloads: list[bytes]) -> list[KvEventBatch | KvEventBatchWithoutTokens]:
    decode = KvBatchDecoder().decode_or_none
    batches = [decode(payload, "bench") for payload in payloads]
    assert all(batches), "the workload's batches decode"
    return batches  # type: ignore[return-value]


def _new_index(workload: _Workload, *, verify_hashes: bool = False) -> KvIndex:
    index = KvIndex(verify_hashes=verify_hashes, trust_chains=True)  # as the router builds it (services.router.kv.model_kv)
    for name in workload.fleet.names:
        index.add_worker(name, workload.fleet.block_size)
    return index


def _ingest_round(workload: _Workload, index: KvIndex, tree) -> dict:
    """The events into `index` (decoded beforehand: ingest alone), into a second index as the
    router takes them (each batch decoded from the bytes a worker publishes, then ingested),
    and into `tree`, chunk by chunk, taking turns going first."""
    wire_index = _new_index(workload)
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


def _match_round(workload: _Workload, index: KvIndex, tree) -> dict:
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


def _resync_round(workload: _Workload, index: KvIndex, tree) -> dict:
    """A worker of `snapshot.blocks` blocks joins the loaded index and resyncs (see the docstring)."""
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


def _verify_ingest_s(workload: _Workload) -> float:
    """Wall seconds to ingest the events with verification (chains recomputed from token ids)."""
    index = _new_index(workload, verify_hashes=True)
    wall = timed(lambda: [index.ingest(batch) for chunk in workload.chunks for batch in chunk.batches])[0]
    assert index.stats().mismatched_blocks == 0, "the workload's chain hashes are Tandem's"
    return wall


def _decode_round(workload: _Workload, ingest_row: dict) -> dict:
    """The router's decoding of every batch alone (token ids sent, packed), per CPU second;
    with this round's ingest alone, their sum (`_summed`: how runs before measured decode plus
    ingest, `_ingest_round` now times the two together) and its ratio to Dynamo's `apply_event`."""
    decode = KvBatchDecoder().decode_or_none
    cpu = timed(lambda: [decode(payload, "bench") for payloads in workload.payloads for payload in payloads])[1]
    seconds_per_block = 1 / ingest_row["tandem_ingest_blocks_per_cpu_s"] + cpu / workload.blocks
    row = {"tandem_decode_ns_per_block_with_token_ids": round(cpu / workload.blocks * 1e9),
           "tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids_summed": round(1 / seconds_per_block)}
    if "dynamo_ingest_blocks_per_cpu_s" in ingest_row:
        row["decode_and_ingest_ratio_cpu_with_token_ids_summed"] = round(
            1 / seconds_per_block / ingest_row["dynamo_ingest_blocks_per_cpu_s"], 3)
    return row


def _spread(rounds: list[dict], key: str) -> dict:
    values = [row[key] for row in rounds if key in row]
    if not values:
        return {}
    return {f"{key}_median": round(statistics.median(values), 4), f"{key}_min": min(values), f"{key}_max": max(values)}


SUMMARY_KEYS = ("tandem_ingest_blocks_per_s", "dynamo_ingest_blocks_per_s", "ingest_ratio", "ingest_ratio_cpu",
                "tandem_ingest_blocks_per_cpu_s", "dynamo_ingest_blocks_per_cpu_s", "chunk_ratio_min",
                "tandem_match_p99_ms", "dynamo_match_p99_ms", "tandem_match_p50_ms", "dynamo_match_p50_ms",
                "tandem_resync_after_gap_s", "tandem_resync_cold_s", "tandem_resync_event_by_event_s",
                "dynamo_resync_after_gap_s", "tandem_decode_ns_per_block_with_token_ids",
                "tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids", "decode_and_ingest_ratio_cpu_with_token_ids",
                "tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids_summed",
                "decode_and_ingest_ratio_cpu_with_token_ids_summed", "dynamo_ingest_blocks_per_calling_thread_cpu_s",
                "dynamo_other_threads_cpu_share", "decode_and_ingest_ratio_to_dynamo_calling_thread")


def _bench_fleet(workers: int, args: argparse.Namespace, radix_tree: type | None) -> dict:
    started = time.perf_counter()
    workload = _build(workers, args.blocks, args.prompt_tokens, args.block_size, args.queries, args.seed,
                      args.resync_blocks)
    print(f"bench_index: {workers} workers: {workload.blocks} blocks in {workload.events} events built in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    gc.collect()
    gc.freeze()
    try:
        rounds = []
        for number in range(args.rounds):
            index = _new_index(workload)
            tree = radix_tree() if radix_tree is not None else None
            row = {"round": number} | _ingest_round(workload, index, tree)
            row |= _decode_round(workload, row) | _match_round(workload, index, tree)
            if number == 0:  # before the resync: a million blocks come and go, and dicts keep their size
                bytes_per_block = round(index.memory_bytes() / workload.blocks)
                distinct_blocks = index.stats().total_blocks
            row |= _resync_round(workload, index, tree)
            rounds.append(row)
            print(f"  round {number}: " + ", ".join(f"{key}={row[key]}" for key in (
                "tandem_ingest_blocks_per_s", "dynamo_ingest_blocks_per_s", "ingest_ratio",
                "decode_and_ingest_ratio_cpu_with_token_ids", "dynamo_other_threads_cpu_share", "tandem_match_p99_ms",
                "dynamo_match_p99_ms", "tandem_resync_after_gap_s", "load_average_1m") if key in row), file=sys.stderr)
            del index, tree
        verify_wall = _verify_ingest_s(workload)
        summary: dict = {}
        for key in SUMMARY_KEYS:
            summary |= _spread(rounds, key)
        if radix_tree is not None:
            summary["ingest_ratio_goal_met_every_round"] = all(row["ingest_ratio"] >= INGEST_RATIO_GOAL for row in rounds)
            summary["decode_and_ingest_ratio_goal_met_every_round"] = all(
                row["decode_and_ingest_ratio_cpu_with_token_ids"] >= DECODE_AND_INGEST_RATIO_GOAL for row in rounds)
            summary["match_p99_goal_met_every_round"] = all(
                row["tandem_match_p99_ms"] <= row["dynamo_match_p99_ms"] for row in rounds)
        wire = wire_costs(workload.chunks[0], workload.payloads[0], workload.fleet.block_size)
        # Dynamo parses its JSON events inside apply_event; Tandem's adapter decodes msgpack before
        # ingest. Ingest with that decoding, per CPU second: the rounds' median with the router's
        # decoder; the others derived from the median ingest rate and the first chunk's decoding.
        summary["tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids"] = round(summary[
            "tandem_decode_and_ingest_blocks_per_cpu_s_with_token_ids_median"])
        for name in ("full_decode_ns_per_block_with_token_ids", "decode_ns_per_block_chain_hashes_only"):
            seconds = 1 / summary["tandem_ingest_blocks_per_cpu_s_median"] + wire[name] / 1e9
            summary["tandem_" + name.replace("_ns_per_block", "_and_ingest_blocks_per_cpu_s")] = round(1 / seconds)
        return {"workers": workers, "blocks": workload.blocks, "events": workload.events,
                "distinct_blocks": distinct_blocks, "bytes_per_block": bytes_per_block,
                "verify_ingest_blocks_per_s": round(workload.blocks / verify_wall),
                **wire, "summary": summary, "rounds": rounds}
    finally:
        gc.unfreeze()


def run_index_bench(args: argparse.Namespace) -> dict:
    radix_tree = None if args.no_dynamo else _load_radix_tree()
    fleets = [_bench_fleet(workers, args, radix_tree) for workers in args.workers_list]
    return {"bench": "index", "dynamo": radix_tree is not None,
            "config": {"workers": args.workers_list, "blocks": args.blocks, "rounds": args.rounds,
                       "queries": args.queries, "prompt_tokens": args.prompt_tokens, "block_size": args.block_size,
                       "resync_blocks": args.resync_blocks, "seed": args.seed},
            "fleets": fleets}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench index", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,256,1024", help="comma-separated fleet sizes")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (the default anyway)")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) pairs to index")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fleet size, on the same events")
    parser.add_argument("--resync-blocks", type=int, default=1_000_000, help="blocks of the worker that resyncs")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-dynamo", action="store_true", help="Tandem figures only")
    parser.add_argument("--out", default="", help="also write the JSON document to this file")
    parser.add_argument("--quick", action="store_true", help="a small run: 4 and 64 workers, 50k blocks, 2 rounds")
    args = parser.parse_args(argv)
    args.workers_list = [int(value) for value in args.workers.split(",")]
    if args.quick:
        args.workers_list, args.blocks, args.queries, args.rounds, args.resync_blocks = [4, 64], 50_000, 200, 2, 100_000
    document = {"command": "tandem bench index " + shlex.join(list(argv if argv is not None else sys.argv[1:]))}
    document |= run_index_bench(args)
    text = json.dumps(document, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
