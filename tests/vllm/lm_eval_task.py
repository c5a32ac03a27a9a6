"""lm-evaluation-harness (`lm-eval`) against an OpenAI endpoint, on two tasks built from local
data files (no download): a log-likelihood task, for which `local-completions` sends each
choice as token ids with `echo`, `logprobs: 1` and `max_tokens: 1` and scores the choices by
the prompt tokens' log-probabilities the server returns; and a greedy generation task (10
documents, up to 16 tokens each, until a newline)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TASK = "tandem_local_choice"
GENERATION_TASK = "tandem_local_generation"
_ANIMALS = ["fox", "dog", "cat", "owl", "bee", "eel", "elk", "yak"]


def write_task(directory: Path) -> Path:
    """A multiple-choice task (acc, acc_norm) of 12 questions with 4 choices each, as a JSON
    lines file and its task config; returns the directory to include."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "questions.jsonl"
    with data.open("w") as out:
        for index in range(12):
            choices = [_ANIMALS[(index + shift) % len(_ANIMALS)] for shift in range(4)]
            out.write(json.dumps({"question": f"Question {index}: the quick brown animal is a",
                                  "choices": [f" {choice}" for choice in choices], "answer": index % 4}) + "\n")
    (directory / f"{TASK}.yaml").write_text("\n".join([
        f"task: {TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {data}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{question}}"',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{answer}}"',
        "metric_list:",
        "  - metric: acc",
        "  - metric: acc_norm",
        ""]))
    _write_generation_task(directory)
    return directory


def _write_generation_task(directory: Path) -> None:
    """10 prompts answered greedily (temperature 0), at most 16 tokens, until a newline."""
    data = directory / "prompts.jsonl"
    with data.open("w") as out:
        for index in range(10):
            out.write(json.dumps({"prompt": f"Story {index}: the {_ANIMALS[index % len(_ANIMALS)]} walked to the river "
                                            "and", "answer": " drank"}) + "\n")
    (directory / f"{GENERATION_TASK}.yaml").write_text("\n".join([
        f"task: {GENERATION_TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {data}",
        "test_split: test",
        "output_type: generate_until",
        'doc_to_text: "{{prompt}}"',
        'doc_to_target: "{{answer}}"',
        "generation_kwargs:",
        "  until: [\"\\n\"]",
        "  max_gen_toks: 16",
        "  do_sample: false",
        "  temperature: 0",
        "metric_list:",
        "  - metric: exact_match",
        ""]))


@dataclass(frozen=True)
class Scores:
    metrics: dict[str, float]  # acc, acc_norm
    loglikelihoods: list[float]  # every choice's, in the harness's order
    generations: list[str]  # the generation task's answers, in document order


def run_lm_eval(completions_url: str, model: str, model_dir: str, task_dir: Path) -> Scores:
    """The task through `local-completions` at `completions_url` (…/v1/completions)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": completions_url, "tokenizer": model_dir,
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1, "timeout": 120},
        tasks=[TASK, GENERATION_TASK], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    metrics = {name: results["results"][TASK][f"{name},none"] for name in ("acc", "acc_norm")}
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    loglikelihoods = [float(response[0][0]) for sample in samples for response in sample["resps"]]
    generated = sorted(results["samples"][GENERATION_TASK], key=lambda sample: sample["doc_id"])
    return Scores(metrics, loglikelihoods, [str(sample["resps"][0][0]) for sample in generated])
