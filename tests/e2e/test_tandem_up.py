"""`tandem up` (what `make run` runs): serves the OpenAI API, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from shared.nats_server import pid_alive

pytestmark = pytest.mark.e2e


def test_tandem_up_serves_and_stops_cleanly(tmp_path: Path, tiny_model_dir: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", "0", "--metrics-port", "0",
                           "--model", tiny_model_dir, "--state-dir", str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        url = up.stdout.readline().strip()  # the only line on stdout: the API URL, once everything is up
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), url
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=5)
        assert reply.usage.completion_tokens == 5
        children = _child_pids(up.pid)
        assert len(children) >= 5  # nats, orchestrator, metrics, 2 workers, router
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0
    deadline = time.monotonic() + 5
    while any(pid_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if pid_alive(pid)], "tandem up left processes behind"


def _child_pids(parent: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]
