"""Retry before recompute (`connector.retry`) and transient injected faults
(`connector.faults.ReadFaults`), without NIXL, NATS or an engine."""

from __future__ import annotations

import asyncio

from connector.faults import ReadFaults, chosen
from connector.retry import BlockRetry, retry_async
from shared.config import KvFaultConfig, KvRetryConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_failed_blocks_are_retried_while_attempts_and_time_are_left() -> None:
    retry = BlockRetry(KvRetryConfig(attempts=2, deadline_ms=100), now=0.0)
    ok = [True, False, True, False]
    assert retry.next(ok, now=0.01) == [1, 3]
    assert abs(retry.timeout_s(now=0.01, cap_s=10.0) - 0.09) < 1e-9 and retry.timeout_s(now=0.01, cap_s=0.05) == 0.05
    retry.merge(ok, [1, 3], [True, False])
    assert ok == [True, True, True, False] and retry.recovered == 1
    assert retry.next(ok, now=0.2) == []  # past the deadline
    assert retry.next(ok, now=0.02) == [3]  # second attempt
    assert retry.next(ok, now=0.03) == []  # no attempt left
    assert retry.retried == 2 and retry.recovered == 1
    assert BlockRetry(KvRetryConfig(attempts=0), now=0.0).next([False], now=0.0) == []
    assert BlockRetry(KvRetryConfig(), now=0.0).next([True, True], now=0.0) == []


def test_the_retry_loop_reads_only_the_failed_blocks_again() -> None:
    reads: list[list[int]] = []

    def read(indices: list[int], timeout_s: float) -> list[bool]:
        assert 0 < timeout_s <= 0.5
        reads.append(indices)
        return [index != 2 for index in indices]  # block 2 fails for good

    async def read_async(indices: list[int], timeout_s: float) -> list[bool]:
        return read(indices, timeout_s)

    ok = [False, True, False]
    retry = asyncio.run(retry_async(KvRetryConfig(attempts=3), ok, read_async, cap_s=1.0, clock=Clock()))
    assert ok == [True, True, False] and reads == [[0, 2], [2], [2]]
    assert retry.retried == 2 and retry.recovered == 1

    reads.clear()
    ok = [False, True, False]
    retry = asyncio.run(retry_async(KvRetryConfig(), ok, read_async, cap_s=1.0, clock=Clock()))
    assert ok == [True, True, False] and reads == [[0, 2]] and retry.recovered == 1


def _read(faults: ReadFaults, remote: list[int]) -> list[bool]:
    ok = [True] * len(remote)
    faults.inject("holder", remote, remote, ok, lambda block_id: None)
    return ok


def test_transient_faults_fail_a_block_n_times_then_let_it_through() -> None:
    config = KvFaultConfig(fail_fraction=0.5, fail_times=1, seed=1)
    blocks = list(range(40))
    failing = [block for block in blocks if chosen(config.seed, "fail", block, config.fail_fraction)]
    assert failing
    faults = ReadFaults(config)
    first = _read(faults, blocks)
    assert [block for block, good in zip(blocks, first) if not good] == failing
    assert all(_read(faults, failing))  # the second read of each succeeds
    permanent = ReadFaults(KvFaultConfig(fail_fraction=0.5, seed=1))
    for _ in range(3):
        assert [block for block, good in zip(blocks, _read(permanent, blocks)) if not good] == failing


def test_a_cut_is_permanent_unless_transient_and_a_retry_is_not_cut_again() -> None:
    for fail_times, retry_lands in ((0, False), (1, True)):
        faults = ReadFaults(KvFaultConfig(cut_after_blocks=2, fail_times=fail_times))
        assert faults.blocks_before_cut("holder", [1, 2, 3, 4]) == 2
        assert faults.blocks_before_cut("holder", [3, 4]) == 2  # the cut-off blocks: not cut again
        assert _read(faults, [3, 4]) == [retry_lands, retry_lands]
