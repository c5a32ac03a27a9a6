"""Turn 2 of 3-turn image conversations landing on another worker than turn 1, with
Tandem's encoder cache (`connector.vllm.encoder_cache`) against without: the time to the
first token of turn 2 (a one-token answer, so prefill plus, without the cache, encoding).

Run with the vLLM venv, from the repository root:

    .venv-vllm/bin/python bench/results/encoder-cache/run.py MODEL_DIR --conversations 8 --rounds 2

Two arms, each a pair of vLLM engines on one core each (A and B): "cache" shares a store,
"none" has none. A conversation's turn 1 and turn 3 go to A, turn 2 to B, so B meets the
image first at turn 2; every conversation has its own image, and on CPU a short turn fills
no 128-token block, so B has no cached prefix either. The arms alternate conversation by
conversation. Prints one JSON object: turn-2 seconds per arm, their medians and the ratio.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from connector.vllm import encoder_cache  # noqa: E402
from connector.vllm.settings import EncoderCacheSettings  # noqa: E402

QUESTIONS = ("What is in this picture?", "Which colour is the most common?", "Describe its left half.")


def image_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def engine(model_dir: str, core: int, store: str | None):
    from vllm import LLM

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    settings = None if store is None else encoder_cache.transfer_config(
        EncoderCacheSettings(root=store, namespace="bench@", budget_bytes=1 << 30))
    return LLM(model=model_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=1024,
               enforce_eager=True, kv_cache_memory_bytes=256 << 20, limit_mm_per_prompt={"image": 1}, seed=0,
               ec_transfer_config=settings)


def conversation(pair, seed: int) -> float:
    """Three turns, turn 2 on the other engine; turn 2's seconds."""
    from vllm import SamplingParams

    answer, first_token = SamplingParams(max_tokens=16, temperature=0.0), SamplingParams(max_tokens=1)
    messages: list[dict] = []
    seconds = 0.0
    for turn, question in enumerate(QUESTIONS):
        content: list[dict] = [{"type": "text", "text": question}]
        if turn == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_url(seed)}, "uuid": f"image-{seed}"})
        messages.append({"role": "user", "content": content})
        llm = pair[turn % 2]
        if turn == 1:
            started = time.perf_counter()
            llm.chat(messages, first_token, use_tqdm=False)
            seconds = time.perf_counter() - started
        [output] = llm.chat(messages, answer, use_tqdm=False)
        messages.append({"role": "assistant", "content": output.outputs[0].text})
    return seconds


def arguments() -> argparse.Namespace:
    """The model directory, and conversations x rounds per arm (this run's and run_router.py's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory() as store:
        arms = {"cache": (engine(args.model_dir, 0, store), engine(args.model_dir, 1, store)),
                "none": (engine(args.model_dir, 0, None), engine(args.model_dir, 1, None))}
        conversation(arms["cache"], 10_000)  # warm-up, both arms, an image of its own
        conversation(arms["none"], 10_001)
        seconds: dict[str, list[float]] = {"cache": [], "none": []}
        for index in range(args.conversations * args.rounds):
            order = ("cache", "none") if index % 2 == 0 else ("none", "cache")
            for arm in order:
                seconds[arm].append(conversation(arms[arm], seed=index * 2 + (arm == "none")))
            print(f"conversation {index + 1}: cache {seconds['cache'][-1]:.3f} s, none {seconds['none'][-1]:.3f} s",
                  file=sys.stderr, flush=True)
    ratios = [cache / none for cache, none in zip(seconds["cache"], seconds["none"], strict=True)]
    print(json.dumps({
        "model_dir": args.model_dir, "conversations": len(ratios),
        "turn2_seconds": seconds,
        "turn2_p50_s": {arm: statistics.median(values) for arm, values in seconds.items()},
        "ratio_cache_to_none": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }, indent=1))


if __name__ == "__main__":
    main()
