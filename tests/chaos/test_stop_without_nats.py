"""A stack whose NATS server is gone (SIGKILLed) still stops promptly on SIGTERM.

A real nats-server of its own, a router, the orchestrator, the metrics collector and two
sim workers. With the server dead every NATS call of a graceful stop (the drain's status,
deregistering, the last KV events, the connection's own drain) can only time out or fail:
each service must still exit by itself within `STOP_BOUND_S` of its SIGTERM, not wait for
the launcher's SIGKILL: with status 0, or for the router by the SIGTERM that uvicorn raises
again once its shutdown is complete (and it must say that it is).
"""

from __future__ import annotations

import signal
import subprocess
import time

from shared.nats_server import EmbeddedNats
from tests.stack_fixtures import make_stack, running

STOP_BOUND_S = 12.0  # the launcher SIGKILLs past 10 s; a clean stop needs far less


def test_every_service_exits_by_itself_when_nats_is_gone(tiny_model_dir: str, tmp_path) -> None:
    with EmbeddedNats(str(tmp_path / "nats")) as nats, \
            running(make_stack(nats, tiny_model_dir, tmp_path / "logs", workers=2)) as stack:
        assert nats.process is not None
        nats.process.kill()
        nats.process.wait()
        time.sleep(1.0)  # every connection has seen the server go
        started = time.monotonic()
        for process in stack.processes.values():
            process.popen.terminate()
        exits: dict[str, tuple[int | None, float]] = {}
        for name, process in stack.processes.items():
            try:
                code: int | None = process.popen.wait(max(0.0, started + STOP_BOUND_S - time.monotonic()))
            except subprocess.TimeoutExpired:  # still running: the fixture's stop SIGKILLs it
                code = None
            exits[name] = (code, round(time.monotonic() - started, 1))
        clean = {name: (0, -signal.SIGTERM) if name == "router" else (0,) for name in exits}
        assert all(code in clean[name] for name, (code, _) in exits.items()), f"exit codes and seconds: {exits}"
        assert "Application shutdown complete" in (tmp_path / "logs" / "router.log").read_text()
