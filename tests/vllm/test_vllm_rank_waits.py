"""On a CPU host vLLM's ranks wait for the next step on the queue's socket, not spinning
(`connector.vllm.rank_waits`): importing Tandem's connector, as each rank does, sets it."""

from __future__ import annotations

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

import connector.vllm.tandem_connector  # noqa: E402,F401  (as a rank imports it)
from connector.vllm.rank_waits import RECHECK_MS, quiet_rank_waits  # noqa: E402


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the ranks spin on GPU hosts, as vLLM chose")
def test_a_cpu_ranks_queue_reader_does_not_spin() -> None:
    assert quiet_rank_waits()  # already in force: the import did it, and doing it again is harmless
    context = zmq.Context()
    # Each reader connects to a writer bound first, as in vLLM's queues: a CONFLATE reader
    # connected to an inproc address nobody bound makes libzmq abort in `term()` now and
    # then ("Assertion failed: ok (src/ctx.cpp:789)", seen in CI's run of this test).
    writers = [shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=f"inproc://tandem-test{n}")
               for n in (1, 2)]
    try:
        reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address="inproc://tandem-test1")
        assert reader.busy_loop_s == 0.0
        # a dropped notification costs at most the recheck interval, not vLLM's 5 s
        assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == RECHECK_MS <= 50
        chosen = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address="inproc://tandem-test2",
                                             busy_loop_s=0.5)
        assert chosen.busy_loop_s == 0.5  # an explicit choice stands
        for condition in (reader, chosen):
            for socket in (condition.local_notify_socket, condition.read_cancel_socket, condition.write_cancel_socket):
                socket.close(linger=0)
    finally:
        for writer in writers:
            writer.local_notify_socket.close(linger=0)
        context.term()
