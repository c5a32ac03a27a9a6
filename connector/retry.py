"""Retry before recompute: the same rule for every engine's reader.

A block that failed to arrive or to verify (`connector.block_reader`) is read once more
(`KvRetryConfig.attempts` times at most) from the same holder, under the same lease, into
the same local block, before it is given up and computed instead. Retries are bounded in
time: none starts later than `deadline_ms` after the first read ended, and each retry's
read is bounded by what is left of the deadline. A route plan names one holder per pull
(`KvTransferParams.prefix_holder` or the P/D handle's), so there is no other holder to
try.

`BlockRetry` is the policy (pure: the caller passes the clock); `retry_async` is its loop,
run by every engine's pull (`connector.block_io.read_verified`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from shared.config import KvRetryConfig

# A retry's read: the indices (into the pull's blocks) to read again and the time it may
# take; per index, whether the block now arrived and verified.
AsyncRead = Callable[[list[int], float], Awaitable[list[bool]]]


class BlockRetry:
    """One pull's retries: which blocks to read again while attempts and time are left, and
    what came of it (`retried`: distinct blocks read again; `recovered`: those that then
    arrived and verified)."""

    def __init__(self, config: KvRetryConfig, now: float) -> None:
        self._attempts_left = config.attempts
        self._deadline = now + config.deadline_ms / 1000
        self._retried: set[int] = set()
        self.recovered = 0

    @property
    def retried(self) -> int:
        return len(self._retried)

    def next(self, ok: Sequence[bool], now: float) -> list[int]:
        """Indices of the blocks to read again now; empty: nothing failed, or give up."""
        failed = [index for index, good in enumerate(ok) if not good]
        if not failed or self._attempts_left <= 0 or now >= self._deadline:
            return []
        self._attempts_left -= 1
        self._retried.update(failed)
        return failed

    def timeout_s(self, now: float, cap_s: float) -> float:
        """How long the retry's read may take: what is left of the deadline, at most `cap_s`."""
        return max(0.0, min(cap_s, self._deadline - now))

    def merge(self, ok: list[bool], indices: Sequence[int], again: Sequence[bool]) -> None:
        """Fold a retry's per-block results into the pull's `ok`."""
        for index, good in zip(indices, again):
            if good and not ok[index]:
                ok[index] = True
                self.recovered += 1


async def retry_async(config: KvRetryConfig, ok: list[bool], read: AsyncRead, *, cap_s: float,
                      clock: Callable[[], float] = time.monotonic) -> BlockRetry:
    """Read the failed blocks of `ok` again until they verify or attempts or time run out;
    updates `ok`."""
    retry = BlockRetry(config, clock())
    while indices := retry.next(ok, clock()):
        retry.merge(ok, indices, await read(indices, retry.timeout_s(clock(), cap_s)))
    return retry
