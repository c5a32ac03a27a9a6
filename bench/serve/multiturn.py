"""`tandem bench serve multiturn`: multi-turn conversations on fresh local stacks of one
prefill and one decode worker, with the cluster prefix pull on and off.

    tandem bench serve multiturn --engine vllm [--conversations 4] [--turns 5] \\
        [--opening-tokens 512] [--user-tokens 32] [--max-tokens 128] [--rounds 1] [--seed 0]

Every run gets the same seeded conversations (`bench.serve.conversations`): turn N+1's
prompt is turn N's prompt, its answer and a new user message. Runs alternate between the
two settings (pull, no pull, pull, no pull, ...: `--rounds` pairs), each on a fresh stack
(no cache carries over) whose router disaggregates every request
(`--local-prefill-tokens`, default 0) and, for "no pull", runs with `--no-prefix-pull`.
Conversations go one at a time, turns in order (TTFT is compute or transfer, never
queueing); one extra conversation of two turns warms each stack up, unmeasured. Answers
are greedy with `ignore_eos`, so both settings see the same tokens.

Prints one JSON document on stdout: `config`, per run its turns and the cluster's transfer
counters, per setting the turn-1 and turn-2+ TTFT figures, and `ratios` (pull over no
pull: below 1, the pull is faster). Progress on stderr. Run it from the vLLM venv for
`--engine vllm`. Not a test.
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
from pathlib import Path

import httpx
import msgspec

from bench.options import add_model_dir
from bench.serve.client import RequestShape, make_client, served_model, stream_request
from bench.serve.conversations import (
    Conversation,
    ConversationSpec,
    TurnResult,
    build_conversations,
    next_prompt,
    turn_figures,
)
from bench.serve.main import CompareSetup
from bench.serve.run import tokenizer_counter
from bench.serve.stats import RequestRecord
from bench.serve.topology import parse_topology, stack_definition
from launch.plan import plan_stack
from launch.stack import LocalStack

SETTINGS = ("pull", "no_pull")
ROUTER_COUNTERS = ("tandem_router_prefix_pulls_total", "tandem_router_kv_pulled_tokens_total",
                   "tandem_router_kv_recomputed_tokens_total", "tandem_router_disaggregated_requests_total")


def _progress(message: str) -> None:
    print(f"bench_serve multiturn: {message}", file=sys.stderr, flush=True)


class TextEncoder:
    """Token ids of a prompt (with the model's BOS) and of a piece appended to one (without)."""

    def __init__(self, model_dir: str) -> None:
        from shared.tokenizer import Tokenizer

        self._tokenizer = Tokenizer.from_model_dir(model_dir)
        self._bos = int(self._tokenizer.add_bos)

    def prompt(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def piece(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)[self._bos:]


async def run_conversations(url: str, conversations: list[Conversation], encoder: TextEncoder, max_tokens: int,
                            timeout_s: float, label: str) -> list[TurnResult]:
    """Each conversation's turns in order, one request at a time."""
    results: list[TurnResult] = []
    async with make_client(url, timeout_s) as client:
        shape = RequestShape(api="completions", model=await served_model(client), max_tokens=max_tokens,
                             timeout_s=timeout_s, ignore_eos=True)
        for index, conversation in enumerate(conversations):
            prompt, answer_ids = encoder.prompt(conversation.opening), []
            for turn in range(1 + len(conversation.messages)):
                if turn:
                    prompt = next_prompt(prompt, answer_ids, encoder.piece(" " + conversation.messages[turn - 1]))
                record = RequestRecord(sent_at=time.monotonic())
                await stream_request(client, shape, prompt, record)
                answer = "".join(record.text)
                answer_ids = encoder.piece(answer)
                results.append(TurnResult(conversation=index, turn=turn + 1, prompt_tokens=len(prompt),
                                          answer_tokens=len(answer_ids), ttft_s=record.ttft_s,
                                          error=None if record.ok else record.error or "unfinished", answer=answer))
                if not record.ok:
                    break  # the next turn has no answer to extend
        failed = sum(not result.ok for result in results)
        _progress(f"{label}: {len(results)} turns, {failed} errors")
    return results


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text family's samples whose labels include `labels`."""
    total = 0.0
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{") \
                and all(label in line for label in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _counters(stack: LocalStack) -> dict:
    """The router's transfer counters and the collector's transfer times, by kind."""
    try:
        router = httpx.get(f"{stack.router_url}/metrics", timeout=10).text
        collector = httpx.get(f"{stack.metrics_url}/metrics", timeout=10).text
    except httpx.HTTPError as error:
        return {"error": repr(error)[:200]}
    counters: dict = {name.removeprefix("tandem_router_"): _metric(router, name) for name in ROUTER_COUNTERS}
    for kind in ("pull", "prefix_pull"):
        counters[kind] = {
            "transfers": _metric(collector, "tandem_kv_transfer_seconds_count", kind=kind),
            "seconds": _metric(collector, "tandem_kv_transfer_seconds_sum", kind=kind),
            "pulled_tokens": _metric(collector, "tandem_kv_transfer_tokens_total", kind=kind, source="pulled")}
    return counters


def _since(after: dict, before: dict) -> dict:
    """The measured part's counters (`after` less the warm-up's), with each transfer kind's
    mean time."""
    out: dict = {}
    for key, value in after.items():
        earlier = before.get(key)
        if isinstance(value, dict) and isinstance(earlier, dict):
            out[key] = _since(value, earlier)
            transfers = out[key].get("transfers")
            if transfers:
                out[key]["mean_ms"] = round(1000 * out[key]["seconds"] / transfers, 3)
        elif isinstance(value, float) and isinstance(earlier, float):
            out[key] = round(value - earlier, 6)
        else:
            out[key] = value
    return out


def run_one(setup: CompareSetup, pull: bool, local_prefill_tokens: int, conversations: list[Conversation],
            warmup: Conversation, encoder: TextEncoder, max_tokens: int, timeout_s: float, label: str) -> dict:
    topology = parse_topology("1p1d")
    definition = stack_definition(topology, setup.engine, setup.model_dir, setup.all_worker_settings())
    router = msgspec.structs.replace(definition.router, settings={
        **definition.router.settings, "local_prefill_tokens": local_prefill_tokens, "prefix_pull": pull})
    definition = msgspec.structs.replace(definition, router=router)
    config = plan_stack(definition, log_dir=str(setup.log_root / label), cores=sorted(os.sched_getaffinity(0)),
                        start_timeout_s=setup.start_timeout_s)
    shutil.rmtree(config.log_dir, ignore_errors=True)
    _progress(f"{label}: starting 1 prefill + 1 decode {setup.engine} worker")
    stack = LocalStack(config)
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as error:
        _progress(f"{label}: the stack did not start: {error}")
        return {"label": label, "pull": pull, "error": f"stack did not start: {error}"[:500]}
    try:
        asyncio.run(run_conversations(stack.router_url, [warmup], encoder, max_tokens, timeout_s, f"{label} warm-up"))
        before = _counters(stack)
        started = time.monotonic()
        turns = asyncio.run(run_conversations(stack.router_url, conversations, encoder, max_tokens, timeout_s,
                                              label))
        duration_s = time.monotonic() - started
        after = _counters(stack)
    except httpx.HTTPError as error:
        _progress(f"{label}: the run failed: {error!r}")
        return {"label": label, "pull": pull, "error": f"run failed: {error!r}"[:500]}
    finally:
        stack.stop()
    figures = turn_figures(turns)
    _progress(f"{label}: turn-2+ ttft p50 {figures['ttft_turn2plus_ms']['p50']} ms, "
              f"p90 {figures['ttft_turn2plus_ms']['p90']} ms")
    return {"label": label, "pull": pull, "duration_s": round(duration_s, 3), "figures": figures,
            "counters": _since(after, before),
            "turns": [dataclasses.asdict(turn) | {"answer": None} for turn in turns], "_results": turns}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator is not None and denominator else None


def summarize_runs(runs: list[dict]) -> dict:
    """Per setting, the figures over all its runs; pull over no-pull ratios; whether every
    run gave the same answers."""
    settings = {}
    for name in SETTINGS:
        results = [turn for run in runs if "error" not in run and run["pull"] == (name == "pull")
                   for turn in run["_results"]]
        settings[name] = turn_figures(results)
    answers = {tuple((turn.conversation, turn.turn, turn.answer) for turn in run["_results"])
               for run in runs if "error" not in run}
    pull, no_pull = (settings[name]["ttft_turn2plus_ms"] for name in SETTINGS)
    return {"settings": settings, "same_answers_in_every_run": len(answers) == 1,
            "ratios": {"ttft_turn2plus_p50": _ratio(pull["p50"], no_pull["p50"]),
                       "ttft_turn2plus_p90": _ratio(pull["p90"], no_pull["p90"])}}


def _parser() -> argparse.ArgumentParser:
    from services.worker.engines import engine_names

    parser = argparse.ArgumentParser(prog="tandem bench serve multiturn", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=engine_names(), default="vllm")
    add_model_dir(parser)
    parser.add_argument("--state-dir", default=".tandem/bench-serve", help="logs and the generated model")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--opening-tokens", type=int, default=512, help="turn 1's prompt")
    parser.add_argument("--user-tokens", type=int, default=32, help="each later user message")
    parser.add_argument("--max-tokens", type=int, default=128, help="each answer (ignore_eos: exactly this many)")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs: pull, no pull, pull, ...")
    parser.add_argument("--local-prefill-tokens", type=int, default=0,
                        help="router flag (0: every request is disaggregated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--sim-speedup", type=float, default=1.0)
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=0, help="worker flag (default: the worker's)")
    parser.add_argument("--start-timeout", type=float, default=0.0, help="seconds for a stack to start")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from shared.tiny_model import model_dir_or_tiny

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        spec = ConversationSpec(conversations=args.conversations, turns=args.turns,
                                opening_tokens=args.opening_tokens, user_tokens=args.user_tokens, seed=args.seed)
    except ValueError as error:
        parser.error(str(error))
    if args.rounds < 1 or args.max_tokens < 1:
        parser.error("--rounds and --max-tokens must be positive")
    state_dir = Path(args.state_dir)
    setup = CompareSetup(engine=args.engine, model_dir=model_dir_or_tiny(args.model_dir, state_dir),
                         log_root=state_dir / "logs" / "multiturn", sim_speedup=args.sim_speedup,
                         vllm_kv_cache_gib=args.vllm_kv_cache_gib,
                         worker_settings={"max_model_len": args.max_model_len} if args.max_model_len else {},
                         start_timeout_s=args.start_timeout)
    count_tokens = tokenizer_counter(setup.model_dir)
    *conversations, warmup = build_conversations(dataclasses.replace(spec, conversations=spec.conversations + 1),
                                                 count_tokens)
    warmup = Conversation(opening=warmup.opening, messages=warmup.messages[:1])
    encoder = TextEncoder(setup.model_dir)
    runs = [run_one(setup, pull, args.local_prefill_tokens, conversations, warmup, encoder, args.max_tokens,
                    args.timeout, f"{'pull' if pull else 'no-pull'}-{round_index + 1}")
            for round_index in range(args.rounds) for pull in (True, False)]
    summary = summarize_runs(runs)
    for run in runs:
        run.pop("_results", None)
    document = {"config": {"engine": setup.engine, "model_dir": setup.model_dir, "topology": "1p1d",
                           "local_prefill_tokens": args.local_prefill_tokens, "rounds": args.rounds,
                           "max_tokens": args.max_tokens, **dataclasses.asdict(spec)},
                **summary, "runs": runs}
    json.dump(document, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
