"""Priorities and fair shares under overload, on a local stack of sim workers:

    tandem bench admission [--workers 2 --max-num-seqs 8 --phase-s 15 --rounds 2 --overload 2.0]

The router runs its admission queue (`--admission-slots-per-seq 1`, a reserve for urgent
requests) behind a key file of four keys: `high` (default priority -1), `low` (0), and
`fair-a`, `fair-b` (0, equal weight). First the capacity is measured (a closed loop holding
every slot busy: requests/s). Then, in alternated rounds:
- unloaded: `high` alone at `--high-share` x capacity;
- overloaded: `high` as before plus `low`, the two offering `--overload` x capacity;
and the high-priority requests' P90 TTFT is compared between the two (goal: overloaded
within 1.5x of unloaded, while `low` absorbs the queueing and refusals). Last, `fair-a` and
`fair-b` offer 3:1, together `--overload` x capacity: each key's share of the tokens served
(goal: each half within 10%). Requests are streamed completions of `--prompt-tokens` and
`--max-tokens` (ignore_eos), with Poisson arrivals per key.

`--baseline` then starts a second stack without the admission queue (the workers' own
first-come-first-served queues, the router's 429 past `--max-queue-factor`) and runs one
overloaded phase and the fair-share phase on it at the same rates, for comparison.

Prints one JSON document on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.admission.load import Stream, key_summary, run_streams
from bench.options import add_model_dir
from bench.serve.client import LoadPlan, RequestShape, make_client, run_requests, served_model
from bench.serve.prompts import PromptSpec, build_prompts
from launch.plan import StackConfig, WorkerSpec
from launch.stack import LocalStack
from shared.api_keys import ApiKey, KeyTable, hash_key
from shared.api_keys_file import new_key, write_key_file

KEYS = {"high": {"priority": -1}, "low": {"priority": 0}, "fair-a": {}, "fair-b": {}}
TTFT_GOAL, SHARE_TOLERANCE = 1.5, 0.10


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem bench admission", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="each sim worker's batch")
    parser.add_argument("--sim-speedup", type=float, default=0.5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds each phase sends")
    parser.add_argument("--rounds", type=int, default=2, help="alternated unloaded/overloaded rounds")
    parser.add_argument("--overload", type=float, default=2.0, help="offered load over capacity when overloaded")
    parser.add_argument("--high-share", type=float, default=0.12, help="high-priority load, a share of capacity")
    parser.add_argument("--reserve", type=float, default=0.35, help="the router's --admission-reserve")
    parser.add_argument("--max-queued", type=int, default=64, help="the router's --admission-max-queued")
    parser.add_argument("--fair-warmup-s", type=float, default=4.0, help="fair phase: seconds before the window")
    parser.add_argument("--baseline", action="store_true", help="also run the same load without the queue")
    parser.add_argument("--seed", type=int, default=0)
    add_model_dir(parser)
    parser.add_argument("--state-dir", default="", help="where logs and keys go (default: a temporary one)")
    return parser.parse_args(argv)


def progress(message: str) -> None:
    print(f"[admission] {message}", file=sys.stderr, flush=True)


def stack_config(args: argparse.Namespace, model_dir: str, key_file: Path, log_dir: Path, *,
                 queue: bool) -> StackConfig:
    settings = {"max_num_seqs": args.max_num_seqs, "sim_speedup": args.sim_speedup}
    workers = tuple(WorkerSpec(worker_id=f"w{i + 1}", settings=settings) for i in range(args.workers))
    router_args = ("--api-keys-file", str(key_file), "--admission-slots-per-seq", "1" if queue else "0",
                   "--admission-reserve", str(args.reserve), "--admission-max-queued", str(args.max_queued))
    return StackConfig(model_dir=model_dir, engine="sim", workers=workers, router_port=0, metrics_port=0,
                       namespace="benchadmission" + uuid.uuid4().hex[:8], log_dir=str(log_dir),
                       router_args=router_args)


async def measure_capacity(base_url: str, shape: RequestShape, api_key: str, slots: int, prompt_tokens: int) -> float:
    """Requests/s with every slot busy (a closed loop of `slots` requests), after a warm-up."""
    async with make_client(base_url, shape.timeout_s, api_key) as client:
        warm = build_prompts(PromptSpec(count=slots, prompt_tokens=prompt_tokens, seed=999))
        await run_requests(client, shape, warm, LoadPlan(concurrency=slots))
        prompts = build_prompts(PromptSpec(count=slots * 8, prompt_tokens=prompt_tokens, seed=998))
        records, duration_s = await run_requests(client, shape, prompts, LoadPlan(concurrency=slots))
    return sum(record.ok for record in records) / duration_s


def priority_streams(args, keys: dict[str, str], capacity: float) -> tuple[Stream, Stream]:
    return (Stream("high", keys["high"], args.high_share * capacity),
            Stream("low", keys["low"], (args.overload - args.high_share) * capacity))


async def priority_rounds(args, base_url: str, shape: RequestShape, keys: dict[str, str], capacity: float) -> dict:
    high, low = priority_streams(args, keys, capacity)
    rounds = []
    for index in range(args.rounds):
        round_figures = {}
        for phase, streams in (("unloaded", [high]), ("overloaded", [high, low])):
            progress(f"round {index + 1}: {phase} ({', '.join(f'{s.key_name} {s.rate_rps:.1f}/s' for s in streams)})")
            records, started, stopped = await run_streams(base_url, shape, streams, args.phase_s, args.prompt_tokens,
                                                          args.seed + 100 * index + len(streams))
            round_figures[phase] = {stream.key_name: key_summary(records, stream.key_name, (started, stopped))
                                    for stream in streams}
        unloaded = round_figures["unloaded"]["high"]["ttft_ms"]["p90"]
        loaded = round_figures["overloaded"]["high"]["ttft_ms"]["p90"]
        round_figures["high_p90_ttft_ratio"] = round(loaded / unloaded, 3) if unloaded and loaded else None
        rounds.append(round_figures)
    ratios = [one["high_p90_ttft_ratio"] for one in rounds if one["high_p90_ttft_ratio"] is not None]
    median = statistics.median(ratios) if ratios else None
    return {"rounds": rounds, "high_p90_ttft_ratio_median": median, "high_p90_ttft_ratios": ratios,
            "goal": f"overloaded high-priority P90 TTFT <= {TTFT_GOAL}x unloaded",
            "met": median is not None and all(ratio <= TTFT_GOAL for ratio in ratios)}


async def fair_phase(args, base_url: str, shape: RequestShape, keys: dict[str, str], capacity: float) -> dict:
    total = args.overload * capacity
    streams = [Stream("fair-a", keys["fair-a"], 0.75 * total), Stream("fair-b", keys["fair-b"], 0.25 * total)]
    duration_s = args.phase_s + args.fair_warmup_s
    progress(f"fair shares: fair-a {streams[0].rate_rps:.1f}/s, fair-b {streams[1].rate_rps:.1f}/s for {duration_s:g}s")
    records, started, stopped = await run_streams(base_url, shape, streams, duration_s, args.prompt_tokens,
                                                  args.seed + 7)
    window = (started + args.fair_warmup_s, stopped)
    per_key = {stream.key_name: key_summary(records, stream.key_name, window) for stream in streams}
    served = sum(figures["window_tokens"] for figures in per_key.values())
    shares = {name: round(figures["window_tokens"] / served, 4) if served else None for name, figures in per_key.items()}
    return {"offered_rps": {stream.key_name: round(stream.rate_rps, 2) for stream in streams},
            "window_s": round(window[1] - window[0], 2), "keys": per_key, "token_shares": shares,
            "goal": f"each key's share of tokens served 0.5 +- {SHARE_TOLERANCE}",
            "met": all(share is not None and abs(share - 0.5) <= SHARE_TOLERANCE for share in shares.values())}


async def request_shape(args: argparse.Namespace, base_url: str, api_key: str) -> RequestShape:
    async with make_client(base_url, 30.0, api_key) as client:
        model = await served_model(client)
    return RequestShape(api="completions", model=model, max_tokens=args.max_tokens, timeout_s=120.0, ignore_eos=True)


async def baseline(args: argparse.Namespace, base_url: str, keys: dict[str, str], capacity: float) -> dict:
    """The overloaded phase and the fair-share phase without the admission queue, same rates."""
    shape = await request_shape(args, base_url, keys["fair-a"])
    streams = list(priority_streams(args, keys, capacity))
    progress("baseline without the admission queue: overloaded")
    records, started, stopped = await run_streams(base_url, shape, streams, args.phase_s, args.prompt_tokens,
                                                  args.seed + 2)
    overloaded = {stream.key_name: key_summary(records, stream.key_name, (started, stopped)) for stream in streams}
    return {"overloaded": overloaded, "fair_shares": await fair_phase(args, base_url, shape, keys, capacity)}


async def run(args: argparse.Namespace, base_url: str, keys: dict[str, str]) -> dict:
    shape = await request_shape(args, base_url, keys["fair-a"])
    slots = args.workers * args.max_num_seqs
    capacity = await measure_capacity(base_url, shape, keys["fair-a"], slots, args.prompt_tokens)
    progress(f"capacity: {capacity:.1f} requests/s with {slots} slots busy")
    priorities = await priority_rounds(args, base_url, shape, keys, capacity)
    fairness = await fair_phase(args, base_url, shape, keys, capacity)
    return {"capacity_rps": round(capacity, 2), "slots": slots, "priorities": priorities, "fair_shares": fairness}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from shared.tiny_model import model_dir_or_tiny

    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="tandem-bench-admission-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir_or_tiny(args.model_dir, state_dir)
    keys = {name: new_key() for name in KEYS}
    key_file = state_dir / "api-keys.jsonl"
    write_key_file(key_file, KeyTable(tuple(ApiKey(name=name, sha256=hash_key(keys[name]), **fields)
                                            for name, fields in KEYS.items())))
    began = time.monotonic()
    stack = LocalStack(stack_config(args, model_dir, key_file, state_dir / "logs", queue=True))
    stack.start()
    try:
        results = asyncio.run(run(args, stack.router_url, keys))
    finally:
        stack.stop()
    if args.baseline:
        stack = LocalStack(stack_config(args, model_dir, key_file, state_dir / "logs-baseline", queue=False))
        stack.start()
        try:
            results["baseline_without_queue"] = asyncio.run(baseline(args, stack.router_url, keys,
                                                                     results["capacity_rps"]))
        finally:
            stack.stop()
    config = {key: value for key, value in vars(args).items() if key not in ("state_dir",)}
    print(json.dumps({"config": {**config, "keys": KEYS, "model_dir": model_dir},
                      "results": results, "wall_s": round(time.monotonic() - began, 1)}, indent=2))
    return 0
