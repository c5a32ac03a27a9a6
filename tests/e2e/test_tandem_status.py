"""`tandem status` as a person and a script run it, against a running stack: the table lists
every worker with its role; `--json` is the collector's cluster view; a collector that
cannot be reached is a clear message and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch.readiness import free_port
from launch.stack import LocalStack

pytestmark = pytest.mark.e2e


def tandem_status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "cli.main", "status", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_table_lists_every_worker(stack: LocalStack) -> None:
    result = tandem_status("--metrics-url", stack.metrics_url)
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 5}
    for spec in stack.config.workers:
        assert spec.worker_id in rows, result.stdout
        assert f" {spec.role.value} " in rows[spec.worker_id]
        assert " active " in rows[spec.worker_id] and " sim " in rows[spec.worker_id]
    assert f"{len(stack.config.workers)} workers" in result.stdout


def test_json_is_the_cluster_view(stack: LocalStack) -> None:
    result = tandem_status("--metrics-url", stack.metrics_url + "/", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert sorted(worker["worker_id"] for worker in status["workers"]) == sorted(
        spec.worker_id for spec in stack.config.workers)
    assert {group["role"] for group in status["roles"]} == {spec.role.value for spec in stack.config.workers}
    assert "recent_errors" in status["activity"]


def test_unreachable_collector_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    for args in ((), ("--json",)):
        result = tandem_status("--metrics-url", url, *args)
        assert result.returncode == 1
        assert result.stdout == ""
        assert "cannot reach the metrics collector" in result.stderr and url in result.stderr
        assert "Traceback" not in result.stderr


def test_a_service_that_is_not_the_collector_is_an_error(stack: LocalStack) -> None:
    result = tandem_status("--metrics-url", stack.router_url)  # the router has no /cluster
    assert result.returncode == 1
    assert "answered HTTP 404" in result.stderr and "Traceback" not in result.stderr
