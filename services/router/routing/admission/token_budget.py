"""Per-key tokens per minute, pure: a bucket of one minute's tokens, refilled continuously.

A request is let through while its key's bucket holds any token, and takes its estimate
(prompt plus max_tokens) at once, so one request may run the bucket into debt; when it
ends, `correct` gives back what it did not use. The next request then waits until the debt
is paid. No clock reads: every call takes `now` (seconds, monotonic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def whole_seconds(seconds: float) -> int:
    """A `Retry-After` for a wait of `seconds`: rounded up, at least 1."""
    return max(1, math.ceil(seconds - 1e-9))


@dataclass
class _Bucket:
    tokens_per_minute: int
    level: float
    updated_at: float

    def refill(self, now: float) -> None:
        rate = self.tokens_per_minute / 60.0
        self.level = min(float(self.tokens_per_minute), self.level + max(0.0, now - self.updated_at) * rate)
        self.updated_at = max(self.updated_at, now)


class TokenBudgets:
    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str, tokens_per_minute: int, tokens: int, now: float) -> float:
        """0.0 when `tokens` were taken from `key`'s budget; else the seconds until it has some."""
        assert tokens_per_minute > 0
        bucket = self._bucket(key, tokens_per_minute, now)
        if bucket.level <= 0:
            return (1.0 - bucket.level) / (tokens_per_minute / 60.0)
        bucket.level -= tokens
        return 0.0

    def correct(self, key: str, tokens: int, now: float) -> None:
        """Give back `tokens` (negative: take more) once a request's real use is known."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.refill(now)
            bucket.level = min(float(bucket.tokens_per_minute), bucket.level + tokens)

    def _bucket(self, key: str, tokens_per_minute: int, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None or bucket.tokens_per_minute != tokens_per_minute:  # a changed limit starts afresh
            bucket = _Bucket(tokens_per_minute, float(tokens_per_minute), now)
            self._buckets[key] = bucket
        bucket.refill(now)
        return bucket
