"""The admission bench's per-key figures (`bench.admission.load.key_summary`), on plain records."""

from __future__ import annotations

from bench.admission.load import KeyedRecord, key_summary
from bench.serve.stats import RequestRecord


def answered(sent_at: float, first_at: float, ended_at: float, prompt: int, output: int) -> RequestRecord:
    return RequestRecord(sent_at=sent_at, text_chunk_at=[first_at], ended_at=ended_at, prompt_tokens=prompt,
                         output_tokens=output)


def test_a_key_s_summary_counts_its_own_requests_refusals_and_the_tokens_ended_in_the_window() -> None:
    records = [KeyedRecord("a", answered(0.0, 0.1, 1.0, 10, 5)),  # ended before the window
               KeyedRecord("a", answered(1.0, 1.2, 3.0, 10, 5)),
               KeyedRecord("a", RequestRecord(sent_at=2.0, error="http 429 overloaded")),
               KeyedRecord("b", answered(1.0, 1.5, 2.5, 99, 99))]
    summary = key_summary(records, "a", window=(2.0, 4.0))
    assert summary["sent"] == 3 and summary["answered"] == 2
    assert summary["errors"] == {"http 429 overloaded": 1}
    assert summary["window_tokens"] == 15 and summary["window_requests"] == 1
    assert summary["ttft_ms"]["count"] == 2 and summary["ttft_ms"]["p50"] == 150.0
