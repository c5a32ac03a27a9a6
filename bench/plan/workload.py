"""A serving workload for the planner's simulator: lengths, arrivals and prefix sharing (pure).

Arrivals are the serving benchmark's own (`bench.serve.prompts.arrival_offsets`, same seed,
same instants), so a prediction and a `tandem bench serve` run see the same request stream.
Lengths are fixed, or uniform within +-spread of the mean. A `prefix_fraction` of the
requests open with the same `shared_prefix_tokens` (a prefill worker that computed it once
skips it afterwards).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass

import msgspec
import numpy as np

from bench.serve.prompts import arrival_offsets


class PlanWorkload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    num_requests: int = 200
    arrival_rate: float = 4.0  # Poisson arrivals per second
    prompt_tokens: int = 1024
    prompt_spread: float = 0.0  # lengths uniform in mean x [1 - spread, 1 + spread]
    output_tokens: int = 64
    output_spread: float = 0.0
    prefix_fraction: float = 0.0  # share of requests opening with the shared prefix
    shared_prefix_tokens: int = 0
    seed: int = 0

    def validate(self) -> None:
        if self.num_requests < 1 or self.arrival_rate <= 0 or self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("the workload needs requests, a positive rate and positive lengths")
        if not (0 <= self.prompt_spread < 1 and 0 <= self.output_spread < 1 and 0 <= self.prefix_fraction <= 1):
            raise ValueError("spreads must lie in [0, 1) and prefix_fraction in [0, 1]")
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens * (1 - self.prompt_spread):
            raise ValueError("shared_prefix_tokens must be shorter than every prompt")


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int  # leading tokens shared with other requests (0: none)


def load_workload(path: str, **overrides: object) -> PlanWorkload:
    """A workload from a TOML file (a `[workload]` table or top-level keys), flags winning."""
    with open(path, "rb") as file:
        table = tomllib.load(file)
    table = table.get("workload", table)
    return msgspec.convert({**table, **{k: v for k, v in overrides.items() if v is not None}}, PlanWorkload)


def arrivals(workload: PlanWorkload) -> list[Arrival]:
    rng = np.random.default_rng([workload.seed, 21])

    def lengths(mean: int, spread: float) -> list[int]:
        if spread == 0:
            return [mean] * workload.num_requests
        low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
        return [int(value) for value in rng.integers(low, high + 1, size=workload.num_requests)]

    prompts = lengths(workload.prompt_tokens, workload.prompt_spread)
    outputs = lengths(workload.output_tokens, workload.output_spread)
    shared = rng.random(workload.num_requests) < workload.prefix_fraction
    times = arrival_offsets(workload.num_requests, workload.arrival_rate, workload.seed)
    return [Arrival(index=index, at_s=times[index], prompt_tokens=prompts[index], output_tokens=outputs[index],
                    prefix_tokens=workload.shared_prefix_tokens if shared[index] else 0)
            for index in range(workload.num_requests)]
