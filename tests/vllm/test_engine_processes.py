"""vLLM's processes as the worker watches them (`services.worker.vllm.processes`), on real
processes: one of them gone is the engine's failure, and what is left of it is killed then,
so the worker's exit (and its restart) does not wait for vLLM's shutdown timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import psutil

from services.worker.vllm.processes import wait_engine_failure


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


async def test_a_process_gone_is_the_failure_and_the_others_are_killed() -> None:
    popens = [_sleeper(), _sleeper()]
    try:
        processes = [psutil.Process(p.pid) for p in popens]
        watch = asyncio.create_task(wait_engine_failure(processes, lambda: None, lambda: False, poll_s=0.02))
        await asyncio.sleep(0.1)
        assert not watch.done()  # both run: no failure
        popens[0].kill()
        why = await asyncio.wait_for(watch, 5)
        assert f"(pid {popens[0].pid}) is gone" in why
        assert popens[1].wait(5) == -9  # the survivor was killed, not left to a shutdown timeout
    finally:
        for popen in popens:
            popen.kill()
            popen.wait()


async def test_no_failure_is_reported_while_stopping() -> None:
    popen = _sleeper()
    try:
        stopping = True
        watch = asyncio.create_task(wait_engine_failure([psutil.Process(popen.pid)], lambda: None,
                                                        lambda: stopping, poll_s=0.02))
        popen.kill()
        popen.wait()
        await asyncio.sleep(0.1)
        assert not watch.done()  # a stop ends the processes: that is no failure
        watch.cancel()
    finally:
        popen.kill()
        popen.wait()
