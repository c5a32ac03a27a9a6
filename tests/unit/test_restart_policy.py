"""When `tandem up` starts a worker again (launch/restart_policy.py), on plain data."""

from __future__ import annotations

import signal

from launch.restart_policy import GiveUp, Restart, RestartLedger, RestartPolicy, exit_reason
from launch.supervisor import last_error_line

POLICY = RestartPolicy(max_restarts=3, window_s=100.0, first_backoff_s=1.0, max_backoff_s=3.0)


def test_the_backoff_doubles_with_each_exit_up_to_its_cap() -> None:
    ledger = RestartLedger(POLICY)
    delays = []
    for now in (0.0, 10.0, 20.0):
        decision = ledger.on_exit("d1", "exit 3", now)
        assert isinstance(decision, Restart) and decision.reason == "exit 3"
        delays.append((decision.attempt, decision.at - now))
    assert delays == [(1, 1.0), (2, 2.0), (3, 3.0)]  # 4.0 capped at 3.0


def test_one_exit_past_the_limit_within_the_window_gives_up_and_says_why() -> None:
    ledger = RestartLedger(POLICY)
    for now in (0.0, 1.0, 2.0):
        assert isinstance(ledger.on_exit("d1", "exit 3", now), Restart)
    decision = ledger.on_exit("d1", "killed by SIGKILL", 3.0)
    assert isinstance(decision, GiveUp)
    assert decision.reason == "d1 exited 4 times within 100 s (last: killed by SIGKILL); not restarting it again"


def test_exits_older_than_the_window_are_forgotten() -> None:
    ledger = RestartLedger(POLICY)
    for now in (0.0, 1.0, 2.0):
        ledger.on_exit("d1", "exit 3", now)
    decision = ledger.on_exit("d1", "exit 3", 150.0)
    assert isinstance(decision, Restart) and decision.attempt == 1 and decision.at == 151.0


def test_workers_are_counted_apart() -> None:
    ledger = RestartLedger(POLICY)
    for now in (0.0, 1.0, 2.0):
        ledger.on_exit("d1", "exit 3", now)
    decision = ledger.on_exit("p1", "exit 3", 3.0)
    assert isinstance(decision, Restart) and decision.attempt == 1


def test_exit_reasons_name_the_signal_or_the_status_and_the_last_error() -> None:
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-99) == "killed by signal 99"
    assert exit_reason(3, "worker d1: vLLM's engine core died") == "exit 3: worker d1: vLLM's engine core died"
    assert exit_reason(1) == "exit 1"


def test_the_last_error_line_is_the_processs_own_last_word() -> None:
    tail = "INFO serving\nerror: worker d1: vLLM's process VLLM::Worker (pid 7) is gone\nINFO closing sockets\n"
    assert last_error_line(tail) == "worker d1: vLLM's process VLLM::Worker (pid 7) is gone"
    assert last_error_line("INFO a\nINFO b\n") == ""
    assert last_error_line("") == ""
