"""lm-eval's two parity tasks (tests/vllm/lm_eval_task.py: 48 log-likelihoods, 10 greedy
generations) through vLLM's own OpenAI server and through a Tandem 1P1D pair of vLLM
workers, on one model directory, one after the other (2 cores); prints JSON.

    PYTHONPATH=. .venv-vllm/bin/python bench/results/lm-eval/compare.py MODEL_DIR > OUT.json

The server gets a Tandem worker's engine settings (`VllmEngineOptions`, 0.25 GiB of KV
cache, the first core), as the parity suite starts it; the pair is the suite's `pd_pair`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from services.worker.vllm.options import VllmEngineOptions
from shared.nats_server import EmbeddedNats
from tests.vllm.conftest import cores, pd_pair
from tests.vllm.lm_eval_task import Scores, run_lm_eval, write_task
from tests.vllm.parity import vllm_openai_server


def compare(model_dir: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="lm-eval-compare-"))
    task = write_task(work / "task")
    options = VllmEngineOptions(model_dir=model_dir, cpu_threads_bind=str(cores()[0]), kv_cache_gib=0.25)
    with vllm_openai_server(options, work / "vllm") as url:
        theirs = run_lm_eval(f"{url}/v1/completions", options.model_name, model_dir, task)
    with EmbeddedNats() as nats:
        for stack in pd_pair(nats, model_dir, work / "tandem"):
            ours = run_lm_eval(f"{stack.router_url}/v1/completions", options.model_name, model_dir, task)
    return summary(model_dir, ours, theirs)


def summary(model_dir: str, ours: Scores, theirs: Scores) -> dict:
    gaps = [abs(a - b) for a, b in zip(ours.loglikelihoods, theirs.loglikelihoods)]
    return {"model_dir": model_dir, "loglikelihoods": len(gaps), "largest_difference": max(gaps),
            "over_1e-3": sum(gap > 1e-3 for gap in gaps), "over_1e-2": sum(gap > 1e-2 for gap in gaps),
            "metrics": {"tandem": ours.metrics, "vllm": theirs.metrics},
            "generations_equal": sum(a == b for a, b in zip(ours.generations, theirs.generations)),
            "generations": len(ours.generations),
            "tandem": {"loglikelihoods": ours.loglikelihoods, "generations": ours.generations},
            "vllm": {"loglikelihoods": theirs.loglikelihoods, "generations": theirs.generations}}


if __name__ == "__main__":
    print(json.dumps(compare(sys.argv[1]), indent=1))
