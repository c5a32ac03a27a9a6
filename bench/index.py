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

prints one JSON document on stdout, progress on stderr. Not a test. The rounds' parts are
`bench.index_rounds`; this module runs them per fleet size and sums them up.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.index_rounds import (
    build_workload,
    decode_round,
    ingest_round,
    match_round,
    new_index,
    resync_round,
    verify_ingest_s,
)
from bench.index_wire import wire_costs

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
    workload = build_workload(workers, args.blocks, args.prompt_tokens, args.block_size, args.queries, args.seed,
                              args.resync_blocks)
    print(f"bench_index: {workers} workers: {workload.blocks} blocks in {workload.events} events built in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    gc.collect()
    gc.freeze()
    try:
        rounds = []
        for number in range(args.rounds):
            index = new_index(workload)
            tree = radix_tree() if radix_tree is not None else None
            row = {"round": number} | ingest_round(workload, index, tree)
            row |= decode_round(workload, row) | match_round(workload, index, tree)
            if number == 0:  # before the resync: a million blocks come and go, and dicts keep their size
                bytes_per_block = round(index.memory_bytes() / workload.blocks)
                distinct_blocks = index.stats().total_blocks
            row |= resync_round(workload, index, tree)
            rounds.append(row)
            print(f"  round {number}: " + ", ".join(f"{key}={row[key]}" for key in (
                "tandem_ingest_blocks_per_s", "dynamo_ingest_blocks_per_s", "ingest_ratio",
                "decode_and_ingest_ratio_cpu_with_token_ids", "dynamo_other_threads_cpu_share", "tandem_match_p99_ms",
                "dynamo_match_p99_ms", "tandem_resync_after_gap_s", "load_average_1m") if key in row), file=sys.stderr)
            del index, tree
        verify_wall = verify_ingest_s(workload)
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
