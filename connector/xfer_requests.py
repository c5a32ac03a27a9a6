"""XferRequests: a KvAgent's NIXL transfer requests, from creation to release.

Called by `KvAgent._transfer` (connector.nixl_agent), on the agent's executor threads, once
per planned transfer: `post` makes the request (by block index into the prepared descriptor
lists of `connector.block_dlists`, or from the plan's rows), posts it, waits for it to end
(`wait_for_transfer`) and releases it. A NIXL error is a failed result, never an exception.
Releasing an unfinished transfer asks NIXL to cancel it; a handle NIXL refuses to release is
kept and retried at `close()`, which `KvAgent.close` calls once its transfers have ended.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from connector.agent_types import KvAgentConfig, PoolInfo, TransferOp, TransferOutcome, TransferResult
from connector.block_dlists import BlockDlists
from connector.descriptors import TransferPlan
from connector.nixl_runtime import error_code
from shared.errors import ErrorCode


def segment(nixl: Any, mem_type: str) -> Any:
    """The bindings' memory segment of a pool's `mem_type`: registration and descriptor lists
    name it (`KvAgent.register_pool`, `XferRequests`)."""
    return nixl.VRAM_SEG if mem_type == "VRAM" else nixl.DRAM_SEG


def wait_for_transfer(nixl: Any, poll: Callable[[int], Any], op: TransferOp, handle: int, status: Any,
                      deadline: float, spin_us: int,
                      cancel: threading.Event | None) -> tuple[TransferOutcome, ErrorCode | None, str]:
    """How a posted transfer ended: (outcome, error, detail); `poll` is the bindings agent's
    `getXferStatus`. Polls without sleeping for `spin_us`, as raw NIXL callers do (a transfer
    between GPUs is done within it), then sleeps between polls, 20 us doubling to 1 ms: a long
    transfer costs little CPU. Called by `XferRequests.post`."""
    in_progress = nixl.NIXL_IN_PROG
    spin_until = time.perf_counter() + spin_us * 1e-6
    pause = 20e-6
    while status == in_progress:
        if cancel is not None and cancel.is_set():
            return TransferOutcome.CANCELLED, ErrorCode.CANCELLED, "cancelled by the caller"
        now = time.perf_counter()
        if now > deadline:
            return TransferOutcome.FAILED, ErrorCode.TIMEOUT, f"{op} not complete in time"
        if now > spin_until:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        status = poll(handle)
    if status != nixl.NIXL_SUCCESS:
        return TransferOutcome.FAILED, ErrorCode.INTERNAL, f"{op} ended with {status}"
    return TransferOutcome.DONE, None, ""


class XferRequests:
    def __init__(self, agent: Any, nixl: Any, errors: tuple[type[Exception], ...], dlists: BlockDlists,
                 config: KvAgentConfig) -> None:
        self._agent, self._nixl, self._errors = agent, nixl, errors
        self._dlists, self._config = dlists, config
        self._lock = threading.Lock()
        self._unreleased: list[int] = []  # transfer handles NIXL refused to release

    def post(self, op: TransferOp, peer: str, local_pool: PoolInfo, peer_pool: PoolInfo, plan: TransferPlan,
             started: float, timeout_s: float | None, cancel: threading.Event | None,
             notify: bytes) -> TransferResult:
        """Run one planned transfer to its end; `started` is when the caller began it."""
        if plan.refusal:
            return TransferResult.refused(peer, TransferOutcome.FAILED, ErrorCode.INVALID_ARGUMENT, plan.refusal)
        result = functools.partial(TransferResult, peer=peer, num_blocks=plan.num_blocks, nbytes=plan.nbytes,
                                   descriptors=plan.descriptors)
        if not plan.descriptors:
            return result(outcome=TransferOutcome.DONE, elapsed_s=0.0)
        deadline = started + (timeout_s if timeout_s is not None else self._config.default_timeout_s)
        handle = dlists = None
        try:
            if plan.local_indices is None:
                handle = self._create_request(op, peer, local_pool, peer_pool, plan, notify)
            elif (dlists := self._dlists.take(peer)) is None:
                return result(outcome=TransferOutcome.FAILED, elapsed_s=0.0, error=ErrorCode.NOT_FOUND,
                              detail=f"peer {peer!r} was removed")
            else:
                handle = self._agent.makeXferReq(self._operation(op), dlists[0], plan.local_indices, dlists[1],
                                                 plan.remote_indices, notify, [], False)
            spin_us = self._config.spin_us_between(local_pool.mem_type, peer_pool.mem_type)
            outcome, error, detail = wait_for_transfer(self._nixl, self._agent.getXferStatus, op, handle,
                                                       self._agent.postXferReq(handle), deadline, spin_us, cancel)
            return result(outcome=outcome, elapsed_s=time.perf_counter() - started, error=error, detail=detail)
        except self._errors as error:
            return result(outcome=TransferOutcome.FAILED, elapsed_s=time.perf_counter() - started,
                          error=error_code(self._nixl, error), detail=f"{op}: {type(error).__name__}: {error}")
        finally:
            if handle is not None:
                self._release(handle)
            if dlists is not None:
                self._dlists.give_back(dlists[1])

    def _operation(self, op: TransferOp) -> Any:
        return self._nixl.NIXL_READ if op == "READ" else self._nixl.NIXL_WRITE

    def _create_request(self, op: TransferOp, peer: str, local_pool: PoolInfo, peer_pool: PoolInfo,
                        plan: TransferPlan, notify: bytes) -> int:
        nixl = self._nixl
        return self._agent.createXferReq(self._operation(op),
                                         nixl.nixlXferDList(segment(nixl, local_pool.mem_type), plan.local_rows),
                                         nixl.nixlXferDList(segment(nixl, peer_pool.mem_type), plan.remote_rows),
                                         peer, notify, [])

    def _release(self, handle: int) -> None:
        try:
            status = self._agent.releaseXferReq(handle)
        except self._errors:
            status = None
        if status != self._nixl.NIXL_SUCCESS:
            with self._lock:
                self._unreleased.append(handle)

    def close(self) -> None:
        """Retry the handles NIXL refused to release, then let go of the bindings agent (its
        destructor joins NIXL's threads once the KvAgent lets go too)."""
        with self._lock:
            unreleased, self._unreleased = self._unreleased, []
        for handle in unreleased:
            try:
                self._agent.releaseXferReq(handle)
            except self._errors:
                pass
        self._agent = None
