"""Per-key request limits, pure: a token bucket for the rate and a count of requests in
flight. No clock reads: every call takes `now` (seconds, monotonic).

`KeyLimiter.admit(key, now)` answers an `Admission`; an admitted request holds one
concurrency slot until `release(name)`. Concurrency is checked first, so a request refused
for concurrency spends no token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from services.router.routing.in_flight import end_one
from shared.api_keys import ApiKey


class Outcome(str, Enum):
    ACCEPTED = "accepted"
    RATE_LIMITED = "rate_limited"
    CONCURRENCY_LIMITED = "concurrency_limited"


@dataclass(frozen=True, slots=True)
class Admission:
    outcome: Outcome
    retry_after_s: int = 0  # whole seconds, at least 1 when refused

    @property
    def accepted(self) -> bool:
        return self.outcome is Outcome.ACCEPTED


class TokenBucket:
    """`size` tokens at most, refilled at `rate` per second; a request takes one."""

    def __init__(self, rate: float, size: int, now: float) -> None:
        assert rate > 0 and size >= 1
        self.rate = rate
        self.size = size
        self.tokens = float(size)
        self.updated_at = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)  # a clock never runs back; a caller's might
        self.tokens = min(float(self.size), self.tokens + elapsed * self.rate)
        self.updated_at = max(self.updated_at, now)

    def take(self, now: float) -> float:
        """0.0 when a token was taken; else the seconds until one will be there."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


def retry_after(seconds: float) -> int:
    """`Retry-After` is whole seconds: rounded up, so a retry then finds a token; at least 1."""
    return max(1, math.ceil(seconds - 1e-9))


class KeyLimiter:
    """The limits' state of every key, by key name. A key whose limits change in the key file
    gets a fresh bucket; its requests in flight still count."""

    def __init__(self) -> None:
        self._buckets: dict[str, tuple[tuple[float, int], TokenBucket]] = {}
        self.in_flight: dict[str, int] = {}

    def admit(self, key: ApiKey, now: float) -> Admission:
        running = self.in_flight.get(key.name, 0)
        if key.max_concurrent is not None and running >= key.max_concurrent:
            return Admission(Outcome.CONCURRENCY_LIMITED, retry_after_s=1)
        if key.rps is not None:
            wait_s = self._bucket(key, now).take(now)
            if wait_s > 0:
                return Admission(Outcome.RATE_LIMITED, retry_after_s=retry_after(wait_s))
        self.in_flight[key.name] = running + 1
        return Admission(Outcome.ACCEPTED)

    def release(self, name: str) -> None:
        end_one(self.in_flight, name, "a request's release")

    def _bucket(self, key: ApiKey, now: float) -> TokenBucket:
        assert key.rps is not None
        shape = (key.rps, key.bucket_size)
        held = self._buckets.get(key.name)
        if held is None or held[0] != shape:
            held = (shape, TokenBucket(key.rps, key.bucket_size, now))
            self._buckets[key.name] = held
        return held[1]
