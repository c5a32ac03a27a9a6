"""NVIDIA Dynamo's frontend figures for the routing benchmark, parsed from the text of its
Prometheus `/metrics` (pure: `bench.routing.dynamo.DynamoStack` and `dynamo_system` fetch it).

`DynamoCounters` (`parse_counters`), cumulative since the stack started, its probe
included: take differences.
- `prompt_tokens`: sum of `dynamo_frontend_input_sequence_tokens` (prompt tokens of every
  request the frontend served);
- `cached_tokens`: sum of `dynamo_frontend_cached_tokens`, the per-request
  `usage.prompt_tokens_details.cached_tokens`: the prompt tokens the engine found in its own
  prefix cache when it scheduled the request (the mocker reports its real hit, so it counts
  under round-robin too; Dynamo has no cross-worker pull, so nothing is "pulled"). As in
  vLLM, whole blocks only, and a prompt's last token is always computed: a repeated prompt
  of 64 tokens (4 blocks of 16) reports 48 cached;
- `requests`: how many requests those sums cover.
`cached / prompt` is the run's cached share, comparable with Tandem's hit rate minus its pulls.
`parse_router_counters` adds the KV router's own view (kv mode only): the prefix tokens it
predicted cached on the worker it chose (`dynamo_component_router_kv_selected_cached_prefix
_tokens_total`) and its registered workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class DynamoCounters:
    """Cumulative frontend figures (see the module docstring); `after - before` is a run's."""

    requests: int
    prompt_tokens: int
    cached_tokens: int

    def __sub__(self, other: DynamoCounters) -> DynamoCounters:
        return DynamoCounters(self.requests - other.requests, self.prompt_tokens - other.prompt_tokens,
                              self.cached_tokens - other.cached_tokens)

    @property
    def cached_share(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def _samples(metrics_text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(metrics_text) for sample in family.samples]


def parse_counters(metrics_text: str) -> DynamoCounters:
    """`DynamoCounters` from the text of the frontend's `/metrics` (0 before the first request)."""
    values: dict[str, float] = {}
    for name, _, value in _samples(metrics_text):
        values[name] = values.get(name, 0.0) + value
    return DynamoCounters(requests=int(values.get("dynamo_frontend_input_sequence_tokens_count", 0)),
                          prompt_tokens=int(values.get("dynamo_frontend_input_sequence_tokens_sum", 0)),
                          cached_tokens=int(values.get("dynamo_frontend_cached_tokens_sum", 0)))


def parse_router_counters(metrics_text: str) -> dict[str, int]:
    """The KV router's view: `predicted_cached_tokens` (prefix tokens it expected cached on
    the workers it chose) and `registered_workers`; zeros in round-robin/random mode."""
    predicted, workers = 0.0, set()
    for name, labels, value in _samples(metrics_text):
        if name == "dynamo_component_router_kv_selected_cached_prefix_tokens_total":
            predicted += value
        elif name == "dynamo_component_router_worker_registered" and value >= 1:
            workers.add(labels.get("router_worker_id"))
    return {"predicted_cached_tokens": int(predicted), "registered_workers": len(workers)}
