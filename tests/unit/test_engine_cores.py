"""Which cores a vLLM engine's processes start on (`options.bound_cores`), and where NIXL's
progress threads in its ranks may run (`connector.progress_threads.unbound_cpus`)."""

from __future__ import annotations

import os

import pytest

from connector.progress_threads import WORKER_CPUS, unbound_cpus
from services.worker.vllm.options import bound_cores, rank_threads_bind


@pytest.mark.parametrize(("bind", "cores"), [
    ("auto", set()),
    ("nobind", set()),
    ("3", {3}),
    ("0-2,5", {0, 1, 2, 5}),
    ("0,1|2-3", {0, 1, 2, 3}),
])
def test_bound_cores_are_every_core_of_every_rank(bind: str, cores: set[int]) -> None:
    assert bound_cores(bind) == cores


def test_a_tensor_parallel_engines_ranks_share_its_cores_out() -> None:
    bind = rank_threads_bind("0-3", 2, [0, 1, 2, 3])
    assert bind == "0,2|1,3" and bound_cores(bind) == {0, 1, 2, 3}


def test_progress_threads_may_run_where_the_worker_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WORKER_CPUS, "0,2")
    assert unbound_cpus() == {0, 2}


def test_without_a_name_they_may_run_where_the_parent_may(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WORKER_CPUS, raising=False)
    assert unbound_cpus() == os.sched_getaffinity(os.getppid())
