"""One serving workload run against an OpenAI-compatible endpoint: `ServeWorkload` (the
requests, the same in every mode and for every topology), `run_serve` (warm up, then the
measured requests; the figures), and `tokenizer_counter` (prompt lengths in the model's
tokens). Callers: both modes of `main` and `bench.plan.verify` run workloads with it;
`multiturn` and `bench.planner.live` count prompt tokens with `tokenizer_counter`.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from functools import lru_cache

from bench.serve.client import Api, LoadPlan, RequestShape, make_client, run_requests, served_model
from bench.serve.prompts import PromptSpec, TokenCounter, arrival_offsets, build_prompts, one_token_per_word
from bench.serve.stats import RequestRecord, Slo, summarize


def progress(message: str) -> None:
    print(f"bench_serve: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class ServeWorkload:
    """One run's requests: the same in every mode and for every topology."""

    prompts: PromptSpec
    max_tokens: int
    api: Api = "completions"
    concurrency: int = 1  # closed loop, unless request_rate is set
    request_rate: float | None = None  # Poisson arrivals per second (open loop)
    warmup: int = 2
    timeout_s: float = 300.0
    ignore_eos: bool = False
    slo: Slo | None = None  # goodput under it, when given
    per_request: bool = False  # the results carry each request's own figures (`stats.per_request_figures`)

    def plan(self) -> LoadPlan:
        if self.request_rate is None:
            return LoadPlan(concurrency=self.concurrency)
        return LoadPlan(arrivals=tuple(arrival_offsets(self.prompts.count, self.request_rate, self.prompts.seed)))

    def config(self) -> dict:
        prompts = self.prompts
        return {"num_prompts": prompts.count, "prompt_tokens": prompts.prompt_tokens,
                "shared_prefix_tokens": prompts.shared_prefix_tokens, "seed": prompts.seed,
                **{field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                   if field.name not in ("prompts", "concurrency", "slo", "per_request")},
                "slo": dataclasses.asdict(self.slo) if self.slo else None,
                "concurrency": self.concurrency if self.request_rate is None else None}  # open loop: none


class Progress:
    """A stderr line at each tenth of the requests."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.errors = label, total, 0, 0

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += not record.ok
        if self.done == self.total or self.done * 10 // self.total != (self.done - 1) * 10 // self.total:
            progress(f"{self.label}: {self.done}/{self.total} done, {self.errors} errors")


async def run_serve(url: str, workload: ServeWorkload, model: str = "",
                    count_tokens: TokenCounter = one_token_per_word, label: str = "serve",
                    api_key: str = "") -> tuple[str, dict]:
    """Warm up, then run `workload` against `url`; the model served and the results."""
    spec = workload.prompts
    prompts = build_prompts(dataclasses.replace(spec, count=spec.count + workload.warmup), count_tokens)
    measured, warmup = prompts[:spec.count], prompts[spec.count:]
    async with make_client(url, workload.timeout_s, api_key) as client:
        model = model or await served_model(client)
        shape = RequestShape(api=workload.api, model=model, max_tokens=workload.max_tokens,
                             timeout_s=workload.timeout_s, ignore_eos=workload.ignore_eos)
        if warmup:
            records, _ = await run_requests(client, shape, warmup, LoadPlan(concurrency=workload.concurrency))
            failed = sum(not record.ok for record in records)
            progress(f"{label}: warm-up {len(records) - failed}/{len(records)} ok")
        records, duration_s = await run_requests(client, shape, measured, workload.plan(),
                                                 Progress(label, len(measured)))
    return model, summarize(records, duration_s, spec.prompt_tokens, workload.slo, per_request=workload.per_request)


def tokenizer_counter(model_dir: str) -> TokenCounter:
    """Tokens of a piece of text under the model's tokenizer (BOS not counted)."""
    from shared.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_dir(model_dir)
    bos = int(tokenizer.add_bos)

    @lru_cache(maxsize=None)
    def count(piece: str) -> int:
        return len(tokenizer.encode(piece)) - bos

    return count
