"""Where lm-eval's greedy generations differ between vLLM's own OpenAI server and a Tandem 1P1D
pair of vLLM workers, was the first differing step a float tie? Sends the generation task's 10
prompts (tests/vllm/lm_eval_task.py) as lm-eval's `local-completions` sends them (token ids
without BOS, temperature 0, up to 16 tokens, until a newline, seed 1234), with `logprobs: 5`
added, to both, one after the other (2 cores); prints JSON: per prompt, whether the tokens
are equal and, where not, the top-2 log-probabilities each side saw at the first difference.
A third arm, one aggregated Tandem worker (no hand-off), says whether a difference comes from
the split. DTYPE (default auto) is the engines' model dtype, for all three.

    PYTHONPATH=. .venv-vllm/bin/python bench/results/lm-eval/ties.py MODEL_DIR [DTYPE] > OUT.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from launch.plan import WorkerSpec
from services.worker.vllm.options import VllmEngineOptions
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from tests.stack_fixtures import running
from tests.vllm.conftest import cores, pd_pair, vllm_args, vllm_stack
from tests.vllm.lm_eval_task import write_task
from tests.vllm.parity import vllm_openai_server


def prompts(model_dir: str) -> list[list[int]]:
    lines = (write_task(Path(tempfile.mkdtemp(prefix="lm-eval-ties-"))) / "prompts.jsonl").read_text().splitlines()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(json.loads(line)["prompt"], add_special_tokens=False)["input_ids"] for line in lines]


def generate(base_url: str, model: str, ids: list[int]) -> list[dict]:
    """Each generated step: its token and the top log-probabilities the server saw."""
    body = {"model": model, "prompt": ids, "max_tokens": 16, "temperature": 0, "stop": ["\n"],
            "seed": 1234, "logprobs": 5}
    answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).raise_for_status().json()
    logprobs = answer["choices"][0]["logprobs"]
    return [{"token": token, "top": top} for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"])]


def first_difference(ours: list[dict], theirs: list[dict]) -> dict | None:
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a["token"] != b["token"]:
            return {"step": step, "ours": _top2(a["top"]), "theirs": _top2(b["top"])}
    return None if len(ours) == len(theirs) else {"step": min(len(ours), len(theirs)), "lengths": [len(ours), len(theirs)]}


def _top2(top: dict[str, float]) -> dict:
    (first, a), (second, b) = sorted(top.items(), key=lambda item: -item[1])[:2]
    return {"first": [first, a], "second": [second, b], "gap": a - b}


def main(model_dir: str, dtype: str = "auto") -> dict:
    work = Path(tempfile.mkdtemp(prefix="lm-eval-ties-"))
    options = VllmEngineOptions(model_dir=model_dir, cpu_threads_bind=str(cores()[0]), kv_cache_gib=0.25, dtype=dtype)
    asked = prompts(model_dir)
    dtype_args = ("--vllm-dtype", dtype)
    with vllm_openai_server(options, work / "vllm") as url:
        theirs = [generate(url, options.model_name, ids) for ids in asked]
    with EmbeddedNats() as nats:
        for stack in pd_pair(nats, model_dir, work / "pair", dtype_args, prefill_args=dtype_args):
            split = [generate(stack.router_url, options.model_name, ids) for ids in asked]
        single = (WorkerSpec(worker_id="w1", role=WorkerRole.BOTH, extra_args=vllm_args(0, *dtype_args)),)
        with running(vllm_stack(nats, model_dir, work / "single", single)) as stack:
            whole = [generate(stack.router_url, options.model_name, ids) for ids in asked]
    return {"model_dir": model_dir, "dtype": dtype, "split_vs_vllm": _rows(split, theirs),
            "single_vs_vllm": _rows(whole, theirs), "split_vs_single": _rows(split, whole),
            "tokens": {name: [[step["token"] for step in steps] for steps in answers]
                       for name, answers in (("split", split), ("single", whole), ("vllm", theirs))}}


def _rows(ours: list[list[dict]], theirs: list[list[dict]]) -> list[dict]:
    return [{"prompt": index, "equal": [s["token"] for s in a] == [s["token"] for s in b],
             "first_difference": first_difference(a, b)} for index, (a, b) in enumerate(zip(ours, theirs))]


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3]), indent=1))
