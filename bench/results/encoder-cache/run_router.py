"""Turn 2 of 3-turn image conversations landing on another worker than turn 1, through
Tandem's router: two stacks of two vLLM (CPU) workers each, "cache" with a shared
`--vllm-encoder-cache-dir`, "none" without. Turn 2's time to the first token, streamed
through the router (the OpenAI client), with the cache against without.

Run with the vLLM venv, from the repository root:

    .venv-vllm/bin/python bench/results/encoder-cache/run_router.py MODEL_DIR --conversations 8 --rounds 2

Each stack's router pins a request to the worker its `X-Tandem-Worker` header names
(`--routing-policy pinned`): turn 1 and turn 3 go to w1, turn 2 to w2, so w2 meets the
image first at turn 2. Prefix pulls are off in both stacks (`--no-prefix-pull`), so w2 has
the KV of no earlier turn: this is the case the cache is for (a later turn moved by load,
the image sent again in another conversation). Every conversation has its own image.
w1 of both stacks shares core 0, w2 core 1. The arms alternate conversation by
conversation. Prints one JSON object: turn-2 seconds per arm, their medians and the ratio
per conversation pair, and the answers' equality across the arms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from run import arguments, image_url  # noqa: E402  (the offline run's images and options, beside this file)

from launch.plan import StackConfig, WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402

QUESTIONS = ("What is in this picture?", "Which colour is the most common?", "Describe its left half.")
ARMS = ("cache", "none")
ROUTER_ARGS = ("--routing-policy", "pinned", "--no-prefix-pull")


def worker(worker_id: str, core: int, cache_dir: str) -> WorkerSpec:
    args = ["--vllm-cpu-threads-bind", str(core), "--vllm-kv-cache-gib", "0.25", "--max-model-len", "1024"]
    if cache_dir:
        args += ["--vllm-encoder-cache-dir", cache_dir]
    return WorkerSpec(worker_id=worker_id, role=WorkerRole.BOTH, extra_args=tuple(args))


def stack(model_dir: str, arm: str, cache_dir: str, log_dir: Path) -> LocalStack:
    return LocalStack(StackConfig(
        model_dir=model_dir, engine="vllm", workers=(worker("w1", 0, cache_dir), worker("w2", 1, cache_dir)),
        router_port=0, metrics_port=0, namespace=f"encoder-{arm}", router_args=ROUTER_ARGS,
        log_dir=str(log_dir / arm), start_timeout_s=600.0))


async def ask(client: openai.AsyncOpenAI, model: str, messages: list[dict], worker_id: str) -> tuple[str, float]:
    """The greedy answer (16 tokens, streamed) and the seconds to its first token."""
    started = time.perf_counter()
    first = 0.0
    text = []
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0.0, stream=True,
        extra_headers={"X-Tandem-Worker": worker_id})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - started
            text.append(chunk.choices[0].delta.content)
    return "".join(text), first


async def conversation(client: openai.AsyncOpenAI, model: str, seed: int) -> tuple[float, list[str]]:
    """Three turns, turn 2 on w2; turn 2's time to the first token, and the answers."""
    messages: list[dict] = []
    answers, seconds = [], 0.0
    for turn, question in enumerate(QUESTIONS):
        content: list[dict] = [{"type": "text", "text": question}]
        if turn == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_url(seed)}})
        messages.append({"role": "user", "content": content})
        answer, first = await ask(client, model, messages, "w2" if turn == 1 else "w1")
        seconds = first if turn == 1 else seconds
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return seconds, answers


async def measure(urls: dict[str, str], model: str, conversations: int) -> dict:
    clients = {arm: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
               for arm, url in urls.items()}
    try:
        for offset, arm in enumerate(ARMS):  # warm-up: an image of its own per arm
            await conversation(clients[arm], model, 10_000 + offset)
        seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
        equal = 0
        for index in range(conversations):
            answers = {}
            for arm in ARMS if index % 2 == 0 else tuple(reversed(ARMS)):
                turn2, answers[arm] = await conversation(clients[arm], model, seed=index)
                seconds[arm].append(turn2)
            equal += answers["cache"] == answers["none"]
            print(f"conversation {index + 1}: cache {seconds['cache'][-1]:.3f} s, none {seconds['none'][-1]:.3f} s",
                  file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.close()
    ratios = [cache / none for cache, none in zip(seconds["cache"], seconds["none"], strict=True)]
    return {"conversations": conversations, "answers_equal_across_arms": equal,
            "turn2_ttft_s": seconds, "turn2_ttft_p50_s": {arm: statistics.median(values) for arm, values in seconds.items()},
            "ratio_cache_to_none": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                    "pairs_faster_with_cache": sum(ratio < 1 for ratio in ratios)}}


def main() -> None:
    args = arguments()
    model = Path(args.model_dir).name
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as running:
        log_dir = Path(scratch) / "logs"
        urls = {}
        for arm in ARMS:
            started = stack(args.model_dir, arm, str(Path(scratch) / "store") if arm == "cache" else "", log_dir)
            started.start()
            running.callback(started.stop)
            urls[arm] = started.router_url
            print(f"{arm}: stack up at {started.router_url}", file=sys.stderr, flush=True)
        result = asyncio.run(measure(urls, model, args.conversations * args.rounds))
        stored = sorted(path.name for path in (Path(scratch) / "store").rglob("*") if path.is_file())
    print(json.dumps({"model_dir": args.model_dir, "through": "tandem router, pinned", **result,
                      "encoder_store_entries": len(stored)}, indent=1))


if __name__ == "__main__":
    main()
