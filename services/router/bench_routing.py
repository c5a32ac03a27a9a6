"""Routing benchmark: KV-aware routing beside round-robin and random, on a real local stack.

For each workload (`bench_workloads`: "tenants", "multi-turn") and each policy, in
alternation, a fresh stack starts from the `tandem up` definition (`LocalStack`: embedded
NATS, orchestrator, metrics collector, sim workers of role `both`, router), so no cache
carries over from one policy to the next. The sim workers get a KV pool small enough that
the workload's live prefixes fill `--kv-fill` of the cluster, and arrivals come at `--load`
times what the cluster could serve with no cache at all (both derived from the timing
profile). Every policy sees the same seeded arrivals and prompts.

A light client (httpx, one event loop) streams `/v1/completions` with token-id prompts:
TTFT is the time from sending to the first non-empty text chunk; throughput is completion
tokens over the time from the first send to the last answer. The hit rate is cached /
prompt tokens over the run, from the workers' load snapshots (the metrics collector's
`/cluster`); prompt tokens a worker pulled from another worker's cache count as cached
there (`pull_rate` says how many of them were pulled). Requests that fail, or are still
running `--drain` seconds after the last arrival, are errors.

The policy reaches the router as `--routing-policy NAME`: kv-aware is the cost model, the
baselines replace only the choice of worker (prefix pulls still happen).

    tandem bench routing [--quick] [--workers 8] [--duration 20] [--policies kv-aware,round-robin,random]

prints one JSON document (`{"config", "policies", "results": [rows], "p90_ratio_vs_kv_aware"}`)
on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np

from services.orchestrator.stack import LocalStack, StackConfig, WorkerSpec
from services.router.bench_workloads import (
    ConversationsWorkload,
    EngineShape,
    Outcome,
    RunLog,
    TenantsWorkload,
    TimedRequest,
    answer_tokens,
)
from services.worker.sim.profile import load_profile
from services.worker.sim.tokens import fold_tokens

POLICIES = ("kv-aware", "round-robin", "random")
WORKLOADS = ("tenants", "multi-turn")
ROUTER_POLICY_FLAG = "--routing-policy"
SETTLE_TIMEOUT_S = 10.0


def _progress(message: str) -> None:
    print(f"bench_routing: {message}", file=sys.stderr, flush=True)


# ---- how the policy reaches the router -------------------------------------------------------


@dataclass(frozen=True)
class RouterPlan:
    """How one policy is run: the router's flags for it."""

    router_args: tuple[str, ...]
    impl: str


def router_plan(policy: str) -> RouterPlan:
    return RouterPlan(router_args=(ROUTER_POLICY_FLAG, policy), impl=f"router {ROUTER_POLICY_FLAG} {policy}")


def routing_stack(config: StackConfig, plan: RouterPlan) -> LocalStack:
    """The stack definition of `tandem up`, its router running `plan`."""
    return LocalStack(msgspec.structs.replace(config, router_args=plan.router_args))


# ---- the client -----------------------------------------------------------------------------


_chunk = msgspec.json.Decoder()


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                            outcome: Outcome, *, keep_text: bool = False) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                outcome.error = f"http {response.status_code} {_error_code(response.content)}".rstrip()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = _chunk.decode(payload)
                if "error" in chunk:
                    outcome.error = f"stream {_error_code(payload)}"
                    return
                for choice in chunk.get("choices") or ():
                    text = choice.get("text")
                    if text:
                        if outcome.ttft_s is None:
                            outcome.ttft_s = time.monotonic() - outcome.sent_at
                        if keep_text:
                            outcome.text += text
                if chunk.get("usage"):
                    outcome.completion_tokens = chunk["usage"]["completion_tokens"]
        if outcome.completion_tokens != max_tokens:
            outcome.error = f"{outcome.completion_tokens} of {max_tokens} tokens"
        else:
            outcome.ended_at = time.monotonic()
    except asyncio.CancelledError:
        outcome.error = "unfinished"
        raise
    except (httpx.HTTPError, msgspec.DecodeError) as error:
        outcome.error = type(error).__name__


def _error_code(body: bytes | str) -> str:
    """The OpenAI error body's code (or type): a small set of values, to count."""
    try:
        error = _chunk.decode(body)["error"]
        return str(error.get("code") or error.get("type") or "")
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError):
        return ""


def _client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(300.0, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))


async def _finish(tasks: list[asyncio.Task], drain_s: float) -> None:
    """Wait for `tasks` up to `drain_s`; the rest are cancelled (their outcomes say so)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


# ---- cluster counters -------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    prompt: int
    cached: int
    pulled: int
    busy: int  # running + waiting
    per_worker_prompt: dict[str, int]


async def read_counters(http: httpx.AsyncClient, metrics_url: str) -> Counters:
    cluster = (await http.get(f"{metrics_url}/cluster")).json()
    workers = cluster["workers"]
    return Counters(prompt=sum(worker["prompt_tokens_total"] for worker in workers),
                    cached=sum(worker["cached_tokens_total"] for worker in workers),
                    pulled=sum(worker["kv_pulled_tokens_total"] for worker in workers),
                    busy=sum(worker["running"] + worker["waiting"] for worker in workers),
                    per_worker_prompt={worker["worker_id"]: worker["prompt_tokens_total"] for worker in workers})


async def settled_counters(http: httpx.AsyncClient, metrics_url: str) -> Counters:
    """Counters once every worker is idle and two load snapshots in a row agree."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = await read_counters(http, metrics_url)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.6)  # load snapshots come every 0.25 s
        now = await read_counters(http, metrics_url)
        if now.busy == 0 and now == last:
            return now
        last = now
    return last


def cache_figures(before: Counters, after: Counters) -> dict:
    prompt = after.prompt - before.prompt
    share = {worker: after.per_worker_prompt.get(worker, 0) - before.per_worker_prompt.get(worker, 0)
             for worker in after.per_worker_prompt}
    _progress("  prompt tokens per worker: " + ", ".join(f"{worker}={tokens}" for worker, tokens in share.items()))
    return {"hit_rate": round((after.cached - before.cached) / prompt, 4) if prompt else None,
            "pull_rate": round((after.pulled - before.pulled) / prompt, 4) if prompt else None}


# ---- the two workloads ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    router_url: str
    metrics_url: str
    model: str
    model_dir: str
    vocab_size: int
    seed: int
    duration_s: float
    drain_s: float
    rate_rps: float


async def run_tenants(run: Run, workload: TenantsWorkload, concurrency: int) -> dict:
    async with _client(run.router_url) as client, httpx.AsyncClient() as http:
        gate = asyncio.Semaphore(concurrency)

        async def warm(request: TimedRequest) -> Outcome:
            async with gate:
                outcome = Outcome(sent_at=time.monotonic())
                await stream_completion(client, run.model, request.prompt, request.max_tokens, outcome)
                return outcome

        warmup = await asyncio.gather(*(warm(request) for request in workload.warmup(run.vocab_size, run.seed)))
        failed = sum(outcome.error is not None for outcome in warmup)
        if failed:
            _progress(f"  warm-up: {failed} of {len(warmup)} requests failed")
        before = await settled_counters(http, run.metrics_url)
        log = RunLog()
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        for request in workload.requests(run.vocab_size, run.seed, run.rate_rps, run.duration_s):
            delay = start + request.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(sent_at=time.monotonic())
            log.outcomes.append(outcome)
            tasks.append(asyncio.create_task(
                stream_completion(client, run.model, request.prompt, request.max_tokens, outcome)))
        await _finish(tasks, run.drain_s)
        after = await settled_counters(http, run.metrics_url)
    return {**log.summary(), **cache_figures(before, after)}


async def run_conversations(run: Run, workload: ConversationsWorkload, shape: EngineShape) -> dict:
    """Users start over one think-and-answer cycle (not measured: every first turn of that
    phase misses for every policy), then turns sent during the window are measured."""
    from services.router.detokenizer import IncrementalDetokenizer
    from shared.tokenizer import Tokenizer

    log = RunLog()
    mismatches: list[int] = []
    cycle_s = workload.cycle_s(shape)
    async with _client(run.router_url) as client, httpx.AsyncClient() as http:
        start = time.monotonic()
        window_start, window_end = start + cycle_s, start + cycle_s + run.duration_s

        async def user(number: int) -> None:
            rng = np.random.default_rng([run.seed, 7, number])
            await asyncio.sleep(float(rng.uniform(0, cycle_s)))
            for conversation in range(number * 100_000, (number + 1) * 100_000):
                prompt = workload.first_prompt(run.vocab_size, run.seed, conversation)
                state = fold_tokens(prompt)
                for turn in range(workload.turns):
                    outcome = Outcome(sent_at=time.monotonic())
                    if outcome.sent_at >= window_end:
                        return
                    if outcome.sent_at >= window_start:
                        log.outcomes.append(outcome)
                    check = number == 0 and turn == 0 and not mismatches  # is the predicted answer the one served?
                    await stream_completion(client, run.model, prompt, workload.max_tokens, outcome, keep_text=check)
                    if outcome.error is not None:
                        break  # this conversation is lost; the user starts another
                    answer, state = answer_tokens(state, workload.max_tokens, run.vocab_size)
                    if check:
                        detokenizer = IncrementalDetokenizer(Tokenizer.from_model_dir(run.model_dir), prompt)
                        if detokenizer.push(answer) + detokenizer.flush() != outcome.text:
                            mismatches.append(conversation)
                    message = workload.user_message(run.vocab_size, run.seed, conversation, turn)
                    prompt = prompt + answer + message
                    state = fold_tokens(message, state)
                    think_s = workload.think_wall_s(rng, shape.sim_speedup)
                    if time.monotonic() + think_s >= window_end:
                        return
                    await asyncio.sleep(think_s)

        users = [asyncio.create_task(user(number)) for number in range(workload.users(shape))]
        await asyncio.sleep(max(0.0, window_start - time.monotonic()))
        before = await read_counters(http, run.metrics_url)
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        await _finish(users, run.drain_s)
        after = await settled_counters(http, run.metrics_url)
    if mismatches:
        _progress("  WARNING: the served answer differs from the sim's predicted one: later turns are not the "
                  "exact continuation of earlier ones (the hit rate understates reuse)")
    return {**log.summary(), **cache_figures(before, after)}


# ---- one stack per (workload, policy) ---------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    shape: EngineShape
    model_dir: str
    log_root: Path
    worker_args: tuple[str, ...]  # besides --kv-blocks
    seed: int
    duration_s: float
    drain_s: float


def _served_model(router_url: str) -> str:
    return httpx.get(f"{router_url}/v1/models", timeout=10).json()["data"][0]["id"]


def run_one(setup: Setup, workload_name: str, workload: TenantsWorkload | ConversationsWorkload,
            policy: str, plan: RouterPlan) -> dict:
    shape = setup.shape
    kv_blocks = workload.kv_blocks(shape)
    rate = workload.rate_rps(shape)
    log_dir = setup.log_root / f"{workload_name}-{policy}"
    shutil.rmtree(log_dir, ignore_errors=True)
    config = StackConfig(
        model_dir=setup.model_dir,
        workers=tuple(WorkerSpec(worker_id=f"worker-{index + 1}",
                                 extra_args=(*setup.worker_args, "--kv-blocks", str(kv_blocks)))
                      for index in range(shape.workers)),
        router_port=0, metrics_port=0, sim_speedup=shape.sim_speedup, log_dir=str(log_dir),
        heartbeat_interval_s=0.5, ttl_s=5.0)
    offered = (f"{rate:.1f} req/s" if isinstance(workload, TenantsWorkload)
               else f"{workload.users(shape)} users, ~{rate:.1f} turns/s")
    _progress(f"{workload_name} / {policy}: {shape.workers} workers x {kv_blocks} KV blocks, "
              f"{offered} for {setup.duration_s:g}s ({plan.impl})")
    stack = routing_stack(config, plan)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as error:  # the row says so; the other rows still run
        _progress(f"  the stack did not start: {error}")
        return {"workload": workload_name, "policy": policy, "error": f"stack did not start: {error}"[:500],
                "router_policy": plan.impl}
    try:
        from shared.tokenizer import Tokenizer

        run = Run(router_url=stack.router_url, metrics_url=stack.metrics_url, model=_served_model(stack.router_url),
                  model_dir=setup.model_dir, vocab_size=Tokenizer.from_model_dir(setup.model_dir).vocab_size,
                  seed=setup.seed, duration_s=setup.duration_s, drain_s=setup.drain_s, rate_rps=rate)
        pids = [process.pid for process in stack.processes.values()]
        if stack.nats is not None and stack.nats.process is not None:
            pids.append(stack.nats.process.pid)
        cpu_before, wall_before = _cpu_seconds(pids), time.monotonic()
        if isinstance(workload, TenantsWorkload):
            figures = asyncio.run(run_tenants(run, workload, concurrency=shape.workers))
        else:
            figures = asyncio.run(run_conversations(run, workload, shape))
        # a machine short of CPU inflates every policy's TTFT: the row shows how busy it was
        figures["cpu_busy"] = round((_cpu_seconds(pids) - cpu_before)
                                    / ((time.monotonic() - wall_before) * (os.cpu_count() or 1)), 2)
    finally:
        stack.stop()
    row = {"workload": workload_name, "policy": policy, **figures, "offered_rps": round(rate, 2),
           "kv_blocks_per_worker": kv_blocks, "router_policy": plan.impl}
    _progress(f"  -> {json.dumps(figures)}")
    return row


def _cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by `pids` (Linux /proc) and by this process."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def p90_ratios(rows: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per workload: each policy's P90 TTFT over kv-aware's (above 1: kv-aware is better)."""
    ratios: dict[str, dict[str, float | None]] = {}
    for workload in dict.fromkeys(row["workload"] for row in rows):
        base = next((row.get("ttft_p90_ms") for row in rows
                     if row["workload"] == workload and row["policy"] == "kv-aware"), None)
        if not base:
            continue
        ratios[workload] = {row["policy"]: (round(row["ttft_p90_ms"] / base, 2) if row.get("ttft_p90_ms") else None)
                            for row in rows if row["workload"] == workload and row["policy"] != "kv-aware"}
    return ratios


def _model_dir(model_dir: str, state_dir: Path) -> str:
    from shared.tiny_model import ensure_tiny_model

    return model_dir or ensure_tiny_model(str(state_dir / "models" / "tiny"))


def _names(value: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise SystemExit(f"bench_routing: unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench routing", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="sim workers of role both")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per policy")
    parser.add_argument("--drain", type=float, default=30.0,
                        help="seconds to wait for answers after the last arrival; later ones are errors")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--load", type=float, default=None,
                        help="offered rate / cluster capacity with no cache (default: per workload)")
    parser.add_argument("--kv-fill", type=float, default=0.7,
                        help="share of the cluster's KV the live prefixes need")
    parser.add_argument("--tenants", type=int, default=0, help="default: 2 per worker")
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--query-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length (tenants)")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation (multi-turn)")
    parser.add_argument("--sim-speedup", type=float, default=0.25,
                        help="sim speed-up; keeps the offered rate within what this machine's CPUs can drive")
    parser.add_argument("--sim-profile", default="", help="timing profile JSON (default: the packaged one)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-kv-transfer", action="store_true",
                        help="workers without the KV data plane: no prefix pull between workers")
    parser.add_argument("--model-dir", default="", help="default: a generated tiny model")
    parser.add_argument("--state-dir", default=".tandem/bench-routing", help="logs and the generated model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run: 8 s of arrivals per policy")
    parser.add_argument("--json", action="store_true", help="accepted; stdout is always one JSON document")
    args = parser.parse_args(argv)
    policies = _names(args.policies, POLICIES, "policy")
    workload_names = _names(args.workloads, WORKLOADS, "workload")
    duration_s = 8.0 if args.quick else args.duration

    shape = EngineShape(workers=args.workers, block_size=16, max_num_batched_tokens=512, max_model_len=2048,
                        profile=load_profile(args.sim_profile), sim_speedup=args.sim_speedup)
    tenants = TenantsWorkload(tenants=args.tenants or 2 * args.workers, prefix_tokens=args.prefix_tokens,
                              query_tokens=args.query_tokens, max_tokens=args.max_tokens, kv_fill=args.kv_fill,
                              **({"load": args.load} if args.load is not None else {}))
    conversations = ConversationsWorkload(turns=args.turns, kv_fill=args.kv_fill,
                                          **({"load": args.load} if args.load is not None else {}))
    conversations.check(shape.max_model_len)
    workloads = {"tenants": tenants, "multi-turn": conversations}

    state_dir = Path(args.state_dir)
    worker_args = ("--block-size", str(shape.block_size), "--max-num-batched-tokens", str(shape.max_num_batched_tokens),
                   "--max-model-len", str(shape.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                   *(("--sim-profile", args.sim_profile) if args.sim_profile else ()),
                   *(("--no-kv-transfer",) if args.no_kv_transfer else ()))
    setup = Setup(shape=shape, model_dir=_model_dir(args.model_dir, state_dir), log_root=state_dir / "logs",
                  worker_args=worker_args, seed=args.seed, duration_s=duration_s, drain_s=args.drain)
    plans = {policy: router_plan(policy) for policy in policies}

    rows = [run_one(setup, name, workloads[name], policy, plans[policy])
            for name in workload_names for policy in policies]
    document = {
        "bench": "routing",
        "config": {"workers": shape.workers, "duration_s": duration_s, "sim_speedup": shape.sim_speedup,
                   "profile": shape.profile.name, "kv_fill": args.kv_fill, "kv_transfer": not args.no_kv_transfer,
                   "tenants": dataclasses.asdict(tenants), "multi_turn": dataclasses.asdict(conversations),
                   "seed": args.seed},
        "policies": {policy: plan.impl for policy, plan in plans.items()},
        "results": rows,
        "p90_ratio_vs_kv_aware": p90_ratios(rows),
    }
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
