"""Completions over the whole prompt-length range, through the official openai client.

`python -m bench.smoke.lengths --url URL --api-key-file F MODEL` (MODEL: the model directory
option of `bench.options.add_model_dir`) sends one completion per prompt length (1 to the
model's window less the answer: edge lengths around block boundaries and the window, then
seeded random ones), each prompt of random token ids and
`ignore_eos` so the answer has exactly `max_tokens` tokens, and prints one JSON line per
request and a summary: a request counts as ok when it is a 200 with the requested prompt and
completion token counts. Exit status 1 when any is not ok. Needs `transformers` (the vLLM venv)
for the model's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from bench.options import add_model_dir

EDGE_LENGTHS = (1, 2, 5, 17, 64, 127, 128, 129, 255, 512, 999, 1024, 1500, 1999, 2000)


def prompt_lengths(count: int, longest: int, rng: random.Random) -> list[int]:
    edges = [length for length in EDGE_LENGTHS if length <= longest]
    return edges + sorted(rng.randint(1, longest) for _ in range(max(0, count - len(edges))))


def run(url: str, api_key: str, model_dir: str, count: int, window: int, seed: int) -> dict:
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=url, api_key=api_key, timeout=300)
    model = client.models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    special = set(tokenizer.all_special_ids)
    vocabulary = [token for token in range(tokenizer.vocab_size) if token not in special]
    rng = random.Random(seed)
    results = []
    for length in prompt_lengths(count, min(2000, window - 1), rng):
        max_tokens = rng.randint(1, min(40, window - length))
        started = time.perf_counter()
        raw = client.completions.with_raw_response.create(
            model=model, prompt=[rng.choice(vocabulary) for _ in range(length)], max_tokens=max_tokens,
            extra_body={"ignore_eos": True})
        answer = raw.parse()
        result = {"prompt_tokens": length, "max_tokens": max_tokens, "status": raw.status_code,
                  "usage_prompt_tokens": answer.usage.prompt_tokens,
                  "completion_tokens": answer.usage.completion_tokens,
                  "finish_reason": answer.choices[0].finish_reason,
                  "seconds": round(time.perf_counter() - started, 3)}
        result["ok"] = (raw.status_code == 200 and answer.usage.prompt_tokens == length
                        and answer.usage.completion_tokens == max_tokens)
        print(json.dumps(result), flush=True)
        results.append(result)
    return {"requests": len(results), "ok": sum(result["ok"] for result in results), "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key-file", required=True, help="File holding the API key (never the key itself)")
    add_model_dir(parser, default=None, required=True, help_text="The served model's directory (its tokenizer)")
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--window", type=int, default=2048, help="The model's context window")
    parser.add_argument("--seed", type=int, default=7)
    arguments = parser.parse_args()
    summary = run(arguments.url, Path(arguments.api_key_file).read_text().strip(), arguments.model_dir,
                  arguments.count, arguments.window, arguments.seed)
    print(json.dumps(summary))
    sys.exit(0 if summary["ok"] == summary["requests"] else 1)


if __name__ == "__main__":
    main()
