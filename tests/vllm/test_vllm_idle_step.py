"""A step that computes nothing (requests wait for their KV) waits a little for a running
pull on the rank's loader thread, and only then: vLLM steps again at once, and each rank
of a multi-process engine busy-waits between steps, starving the pull itself."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("zmq", reason="vLLM's venv (make install-vllm)")

from connector.vllm.kv_wire import Loaded, LoadSpec  # noqa: E402
from connector.vllm.rank_loads import RankLoads  # noqa: E402
from shared.config import KvFaultConfig, KvRetryConfig  # noqa: E402


class Reports:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, report) -> None:
        self.sent.append(report)


def spec(request_id: str) -> LoadSpec:
    return LoadSpec(request_id=request_id, transfer_id=request_id, lease_id="l", agent_name="holder",
                    agent_metadata=b"", remote_block_ids=[1], local_block_ids=[7], checksums=[0], cached_blocks=0)


def test_an_idle_step_waits_for_a_running_pull_and_no_longer() -> None:
    reports = Reports()
    loads = RankLoads(faults=KvFaultConfig(), retry=KvRetryConfig(), timeout_s=5.0, reports=reports,  # type: ignore[arg-type]
                      peer_of=lambda name, metadata: None)  # type: ignore[arg-type, return-value]
    gate = threading.Event()

    def load(spec: LoadSpec) -> tuple[Loaded, list[int]]:
        gate.wait(5)
        return Loaded(transfer_id=spec.transfer_id, lease_id=spec.lease_id, cached_blocks=0, ok=[True]), []

    loads._load = load  # type: ignore[method-assign]  # noqa: SLF001  (the read itself is the read path's tests')
    try:
        assert loads.take_loaded(0.05) == set()  # nothing running: no wait at all
        loads.load([spec("r1")])
        started = time.perf_counter()
        assert loads.take_loaded(0.0) == set()  # a busy step never waits
        assert loads.take_loaded(0.05) == set()  # an idle one waits up to its bound
        waited = time.perf_counter() - started
        assert 0.04 <= waited < 2.0
        threading.Timer(0.02, gate.set).start()
        started = time.perf_counter()
        assert loads.take_loaded(2.0) == {"r1"}  # ... and ends as the pull does
        assert time.perf_counter() - started < 1.0
        assert [report.transfer_id for report in reports.sent] == ["r1"]
    finally:
        gate.set()
        loads.close()
