"""`tandem up` (what `make run` runs): serves the OpenAI API, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from shared.nats_server import pid_alive
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e


def test_tandem_up_serves_and_stops_cleanly(tmp_path: Path, tiny_model_dir: str) -> None:
    processes = serve_and_stop(tmp_path, tiny_model_dir, "--engine", "sim")
    assert len(processes) >= 6  # nats, orchestrator, metrics, 2 workers, router


def test_tandem_up_started_in_the_background_still_stops_on_ctrl_c(tmp_path: Path, tiny_model_dir: str) -> None:
    """A script's background job (`tandem up &`) starts with SIGINT ignored."""
    serve_and_stop(tmp_path, tiny_model_dir, "--engine", "sim", ctrl_c=True, sigint_ignored=True)


def serve_and_stop(state_dir: Path, model_dir: str, *args: str, start_timeout_s: float = 60,
                   ctrl_c: bool = False, sigint_ignored: bool = False) -> list[int]:
    """Start `tandem up` (with `sigint_ignored`, as a background job of a script), ask for a
    completion and a streamed chat answer, then SIGTERM it, or with `ctrl_c` SIGINT its whole
    process group as a terminal's Ctrl-C does; it must exit 0 with every process it started
    (engines' own included) gone. Returns those pids."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--port", "0", "--metrics-port", "0",
                           "--model", model_dir, "--state-dir", str(state_dir), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
                          start_new_session=True,
                          preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None)
    descendants: list[int] = []
    try:
        url = _first_line(up, start_timeout_s)  # the only line on stdout: the API URL, once everything is up
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), url
        api_key = (state_dir / "api-key").read_text().strip()  # tandem up's own key (`launch.api_keys`)
        with openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=30) as client:
            model = client.models.list().data[0].id
            reply = client.completions.create(model=model, prompt="Hello " * 200, max_tokens=5)
            assert reply.usage.completion_tokens == 5
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=5, stream=True)
            assert [chunk for chunk in stream if chunk.choices and chunk.choices[0].finish_reason]
        descendants = _descendants(up.pid)
    finally:
        if ctrl_c:
            os.killpg(up.pid, signal.SIGINT)
        else:
            up.send_signal(signal.SIGTERM)
        try:
            code = up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()  # its children follow it (parent-death signal)
            up.wait()
            raise AssertionError("tandem up did not stop within 90 s of the signal") from None
    assert code == 0
    wait_for_sync(lambda: not any(pid_alive(pid) for pid in descendants), 10,
                  lambda: f"every process tandem up started to exit (left: {[p for p in descendants if pid_alive(p)]})",
                  interval_s=0.05)
    return descendants


def _first_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    def printed() -> bool:
        if select.select([process.stdout], [], [], 0.2)[0]:  # blocks up to 0.2 s: the poll interval
            return True
        assert process.poll() is None, f"tandem up exited with {process.returncode}"
        return False

    wait_for_sync(printed, timeout_s, "tandem up to print its URL", interval_s=0)
    return process.stdout.readline().strip()  # printed whole, with a flush


def _descendants(parent: int) -> list[int]:
    found, frontier = [], [parent]
    while frontier:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", ",".join(map(str, frontier))],
                             capture_output=True, text=True).stdout
        frontier = [int(pid) for pid in out.split()]
        found += frontier
    return found
