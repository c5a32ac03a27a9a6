"""vLLM's own processes (EngineCore, model worker) as the worker sees them: found when the
engine starts, waited for (then killed) when it stops. Called by `engine.VllmEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)

# How often a running engine's processes are looked at: a dead engine leaves the routing
# pool within about this (plus a membership update).
WATCH_POLL_S = 0.1


def child_pids() -> set[int]:
    """This process's descendants now: what `engine_processes` compares against."""
    return {child.pid for child in psutil.Process().children(recursive=True)}


def engine_processes(before: set[int]) -> list[psutil.Process]:
    """vLLM's processes started since `before`: vLLM names them "VLLM::EngineCore",
    "VLLM::Worker"... (multiprocessing's resource tracker, also new, lives on)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.pid not in before and child.name().startswith("VLLM"):
                found.append(child)
    return found


async def reap_processes(processes: list[psutil.Process], timeout_s: float) -> None:
    """Wait for vLLM's processes to exit (the model worker follows its EngineCore after
    `shutdown` returns, slowly on a busy machine); SIGKILL what is still there."""
    _, alive = await asyncio.to_thread(psutil.wait_procs, processes, timeout_s)
    for process in alive:
        log.warning("vLLM process %d did not exit within %.0f s: killed", process.pid, timeout_s)
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    if alive:
        await asyncio.to_thread(psutil.wait_procs, alive, timeout_s)


def kill_processes(processes: list[psutil.Process]) -> None:
    """SIGKILL those still running (what is left of an engine that died)."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def gone(processes: list[psutil.Process], names: dict[int, str]) -> str | None:
    """Which of vLLM's processes (`names`: pid -> its name at start) is no longer running
    (exited, killed, a zombie its parent has not reaped), said for a log line; None while
    all run."""
    for process in processes:
        try:
            running = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        if not running:
            return f"vLLM's process {names.get(process.pid, 'VLLM')} (pid {process.pid}) is gone"
    return None


async def wait_engine_failure(processes: list[psutil.Process], errored: Callable[[], str | None],
                              stopping: Callable[[], bool], poll_s: float = WATCH_POLL_S) -> str:
    """Returns, with why, once vLLM can no longer serve: one of its processes is gone (a
    model worker killed, SIGILL, out of memory) or `errored()` (AsyncLLM saw its engine
    die) says so, having killed the processes still there. Polls; never returns while
    `stopping()` (a stop ends the processes)."""
    names = {}
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            names[process.pid] = process.name()
    while True:
        await asyncio.sleep(poll_s)
        if stopping():
            continue
        why = errored() or await asyncio.to_thread(gone, processes, names)
        if why:  # what is left of it cannot serve, and vLLM's shutdown would wait 5 s for it
            kill_processes(processes)
            return why
