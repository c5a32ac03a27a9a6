"""Figures of a serving run from per-request records: pure, no I/O, no clock reads.

A `RequestRecord` holds what the client saw of one request as `time.monotonic()` instants;
`summarize` turns a run's records into the result document. Definitions:

- TTFT: send to the first chunk carrying non-empty text.
- ITL: gap between successive chunks carrying text. A chunk that carries several tokens
  counts as one gap (the client cannot see token boundaries), so ITL is per chunk;
  TPOT, from the token count, is per token.
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request with at least 2 tokens.
- Throughputs: tokens (or requests) of successful requests over the run's duration.
- SLO (when given): a request meets it when it succeeded, its TTFT is within the TTFT
  bound and its TPOT (mean time per token after the first) within the ITL bound; goodput
  is the requests that met it per second, attainment their share of all requests.
- Per request (`per_request`, when asked): each request in sending order, its send time
  from the run's first send, TTFT and every inter-chunk gap, so a percentile can be traced
  to the requests and moments that make it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
RATIO_METRICS = {  # ratio name -> (figure, key inside it)
    "ttft_p50": ("ttft_ms", "p50"), "ttft_p90": ("ttft_ms", "p90"), "ttft_p99": ("ttft_ms", "p99"),
    "itl_p50": ("itl_ms", "p50"), "itl_p90": ("itl_ms", "p90"),
    "tpot_p50": ("tpot_ms", "p50"), "e2e_p50": ("e2e_ms", "p50"), "e2e_p90": ("e2e_ms", "p90"),
    "request_throughput": ("request_throughput", None), "output_throughput": ("output_throughput_tok_s", None),
    "goodput": ("slo", "goodput_rps"), "slo_attainment": ("slo", "attainment"),
}


@dataclass(slots=True)
class RequestRecord:
    sent_at: float
    text_chunk_at: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    text: list[str] = field(default_factory=list)  # the text of those chunks (the answer, in pieces)
    ended_at: float | None = None
    prompt_tokens: int | None = None  # from the server's usage, when it sends one
    output_tokens: int = 0
    error: str | None = None  # short reason; None: the request succeeded

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended_at is not None

    @property
    def ttft_s(self) -> float | None:
        return self.text_chunk_at[0] - self.sent_at if self.text_chunk_at else None

    @property
    def e2e_s(self) -> float | None:
        return self.ended_at - self.sent_at if self.ended_at is not None else None

    @property
    def itl_s(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.text_chunk_at, self.text_chunk_at[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request latency bounds, in milliseconds."""

    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("SLO bounds must be positive milliseconds")

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.ttft_s is None or record.ttft_s * 1000.0 > self.ttft_ms:
            return False
        return record.tpot_s is None or record.tpot_s * 1000.0 <= self.itl_ms


def distribution_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """Count, mean and percentiles in milliseconds (None when there are no values)."""
    figures: dict[str, float | int | None] = {"count": len(values_s)}
    if not values_s:
        return {**figures, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    values_ms = np.asarray(values_s) * 1000.0
    figures["mean"] = round(float(values_ms.mean()), 3)
    for q in PERCENTILES:
        figures[f"p{q}"] = round(float(np.percentile(values_ms, q)), 3)
    return figures


def summarize(records: list[RequestRecord], duration_s: float, nominal_prompt_tokens: int,
              slo: Slo | None = None, *, per_request: bool = False) -> dict:
    """The result document of one run. Prompt tokens come from the server's usage, else
    `nominal_prompt_tokens` per request; with `slo`, the goodput under it; with
    `per_request`, each request's own figures (`per_request_figures`)."""
    done = [record for record in records if record.ok]
    output_tokens = sum(record.output_tokens for record in done)
    prompt_tokens = sum(record.prompt_tokens if record.prompt_tokens is not None else nominal_prompt_tokens
                        for record in done)

    def per_second(amount: float) -> float:
        return round(amount / duration_s, 3) if duration_s > 0 else 0.0

    figures = {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "error_kinds": dict(Counter(record.error or "unfinished" for record in records if not record.ok)),
        "duration_s": round(duration_s, 3),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "text_chunks": sum(len(record.text_chunk_at) for record in done),
        "request_throughput": per_second(len(done)),
        "output_throughput_tok_s": per_second(output_tokens),
        "total_token_throughput": per_second(prompt_tokens + output_tokens),
        "ttft_ms": distribution_ms([record.ttft_s for record in done if record.ttft_s is not None]),
        "itl_ms": distribution_ms([gap for record in done for gap in record.itl_s]),
        "tpot_ms": distribution_ms([record.tpot_s for record in done if record.tpot_s is not None]),
        "e2e_ms": distribution_ms([record.e2e_s for record in done if record.e2e_s is not None]),
    }
    if slo is not None:
        met = sum(slo.met_by(record) for record in records)
        figures["slo"] = {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms, "met": met,
                          "attainment": round(met / len(records), 3) if records else None,
                          "goodput_rps": per_second(met)}
    if per_request:
        figures["per_request"] = per_request_figures(records)
    return figures


def per_request_figures(records: list[RequestRecord]) -> list[dict]:
    """Each request in sending order: sent (ms after the first send), TTFT and the gaps
    between its text chunks (ms), output tokens, and its error if it failed."""
    first = min((record.sent_at for record in records), default=0.0)

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000.0, 1)

    return [{"sent_ms": ms(record.sent_at - first), "ttft_ms": ms(record.ttft_s),
             "itl_ms": [ms(gap) for gap in record.itl_s], "output_tokens": record.output_tokens,
             "error": record.error}
            for record in sorted(records, key=lambda record: record.sent_at)]


def ratios(first: dict, second: dict) -> dict[str, float | None]:
    """Each figure of `first` over the same figure of `second` (None where one is missing or 0)."""
    out: dict[str, float | None] = {}
    for name, (figure, key) in RATIO_METRICS.items():
        numerator, denominator = first.get(figure), second.get(figure)
        if key is not None:
            numerator = numerator.get(key) if isinstance(numerator, dict) else None
            denominator = denominator.get(key) if isinstance(denominator, dict) else None
        out[name] = round(numerator / denominator, 3) if numerator is not None and denominator else None
    return out
