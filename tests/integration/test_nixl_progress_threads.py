"""A KvAgent created by a thread bound to one core (a vLLM rank on a CPU host) leaves NIXL's
progress thread free to run on every core its process may use (`connector.progress_threads`):
bound to the rank's core, a spinning progress thread starved the other engine bound there."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from connector.nixl_agent import KvAgent, nixl_available
from connector.progress_threads import thread_ids

pytestmark = [pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12)"),
              pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs Linux and two cores to bind a thread to fewer than it may use")]


def agent_threads(bind_to: set[int] | None) -> tuple[set[int], dict[int, set[int]]]:
    """Create and register a KvAgent on a fresh thread (bound to `bind_to` where given): the
    creator's binding, and the binding of each thread the agent started."""
    found: dict[str, object] = {}

    def create() -> None:
        if bind_to is not None:
            os.sched_setaffinity(0, bind_to)
        before = thread_ids()
        agent = KvAgent(f"affinity-{bind_to}")
        try:
            agent.register_pool(np.zeros(16 * 4096, dtype=np.uint8), 4096)
            found["started"] = {tid: os.sched_getaffinity(tid) for tid in thread_ids() - before}
        finally:
            found["creator"] = os.sched_getaffinity(0)
            agent.close()

    thread = threading.Thread(target=create)
    thread.start()
    thread.join(60)
    assert "started" in found, "the agent was not created"
    return found["creator"], found["started"]


def test_a_bound_creator_leaves_nixls_threads_every_core_of_its_process() -> None:
    cores = os.sched_getaffinity(0)
    creator, started = agent_threads({min(cores)})
    assert creator == {min(cores)}  # the creator stays bound
    assert started, "NIXL started no thread (its progress thread is on by default in KvAgent)"
    assert all(binding >= cores for binding in started.values()), started  # not the creator's one core


def test_an_unbound_creators_threads_keep_their_binding() -> None:
    cores = os.sched_getaffinity(0)
    creator, started = agent_threads(None)
    assert creator == cores and all(binding == cores for binding in started.values()), started
