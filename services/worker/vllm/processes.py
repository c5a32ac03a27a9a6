"""vLLM's own processes (EngineCore, model worker) as the worker sees them: found when the
engine starts, waited for (then killed) when it stops. Called by `engine.VllmEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psutil

log = logging.getLogger(__name__)


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
