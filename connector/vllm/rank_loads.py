"""Pulls in one model-worker rank (the worker side of Tandem's vLLM connector): each rank
reads its own KV heads of a pull from the holder's ranks that hold them, whatever either
side's shape, through the data plane's one read path (`connector.shaped_read.read_units`,
which the sim's puller reads through too).

A pull (`LoadSpec`) starts in `start_load_kv` of the step that planned it and is read on the
rank's loader thread (one pull at a time; NIXL copies inside the posting call on one host,
bounded by the transfer timeout), so the requests decoding here go on meanwhile; the
pulling request waits in vLLM until `get_finished` names it, in the first step after every
rank's pull ended (vLLM waits for all ranks). The holder's blocks are the pull's units; they
land in vLLM's blocks of this engine's size (`connector.token_map`). vLLM's blocks that did
not come out whole and verified go to vLLM through `get_block_ids_with_load_errors` (vLLM
rolls the request back to its first failed block: every rank's failures count), and each
rank ends each pull in exactly one `Loaded` report (the Tandem worker merges the ranks'),
sent from the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from connector.faults import ReadFaults
from connector.kv_geometry import RankGeometry
from connector.kv_peer import KvPeer
from connector.shaped_read import LocalRank, RangeMover, read_units
from connector.token_map import token_segments
from connector.vllm.kv_reports import ReportSink
from connector.vllm.kv_wire import Loaded, LoadSpec
from shared.config import KvFaultConfig, KvRetryConfig

log = logging.getLogger(__name__)


class RankLoads:
    def __init__(self, *, faults: KvFaultConfig, retry: KvRetryConfig, timeout_s: float, reports: ReportSink,
                 peer_of: Callable[[str, bytes], KvPeer]) -> None:
        self._faults = ReadFaults(faults)
        self._retry = retry
        self._timeout_s = timeout_s
        self._reports = reports
        self._peer_of = peer_of
        self._local: LocalRank | None = None
        self._load_errors: set[int] = set()
        # Pulls run one at a time on a thread of their own, beside the forward passes: the
        # streams decoding here go on while a new request's KV arrives.
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-kv-load")
        self._loader_loop = asyncio.new_event_loop()  # runs each pull's read, on the loader thread only
        self._done_lock = threading.Condition()
        self._done: list[tuple[str, Loaded, list[int]]] = []  # ended pulls: request id, report, failed blocks
        self._running = 0  # pulls submitted to the loader thread, not yet in `_done`
        self.loads = 0  # pulls performed, for diagnostics

    def bind(self, geometry: RankGeometry, region: np.ndarray, mover: RangeMover) -> None:
        self._local = LocalRank(geometry, region, mover)

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._loader_loop.close()

    def load(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            if not spec.local_block_ids:  # nothing to read: vLLM is not waiting for it
                self._reports.send(self._load(spec)[0])
            else:
                with self._done_lock:
                    self._running += 1
                self._loader.submit(self._load_in_background, spec)

    def _load_in_background(self, spec: LoadSpec) -> None:
        try:
            report, failed = self._load(spec)
        except Exception as error:  # a bug: the request still hears, every block failed
            log.exception("pull %s failed", spec.transfer_id)
            report = Loaded(ok=[False] * len(spec.remote_block_ids), reason=f"internal error: {error}", kept=0,
                            transfer_id=spec.transfer_id, lease_id=spec.lease_id, cached_blocks=spec.cached_blocks,
                            rank=self._local.geometry.rank if self._local is not None else 0)
            failed = list(spec.local_block_ids)
        with self._done_lock:
            self._done.append((spec.request_id, report, failed))
            self._running -= 1
            self._done_lock.notify_all()

    def take_loaded(self, wait_s: float = 0.0) -> set[str]:
        """The requests whose loads ended since the last step (vLLM's `get_finished`); their
        failed blocks become this step's load errors, and their reports leave from here (the
        engine thread owns the report socket). `wait_s`: where none ended yet and a pull is
        running, wait that long for one (a step that computed nothing: vLLM steps again at
        once while requests wait for their KV, and every rank of a multi-process engine
        busy-waits between steps, starving the pulls' own threads and their holders)."""
        with self._done_lock:
            if wait_s > 0 and not self._done and self._running:
                self._done_lock.wait_for(lambda: bool(self._done), timeout=wait_s)
            done, self._done = self._done, []
        for _, report, failed in done:
            self._reports.send(report)
            self._load_errors.update(failed)
        return {request_id for request_id, _, _ in done}

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _load(self, spec: LoadSpec) -> tuple[Loaded, list[int]]:
        local = self._local
        assert local is not None, "register_kv_caches() first"
        started = time.perf_counter()
        units = len(spec.remote_block_ids)
        report = dict(transfer_id=spec.transfer_id, lease_id=spec.lease_id, cached_blocks=spec.cached_blocks,
                      rank=local.geometry.rank)
        if not spec.local_block_ids or not units:
            return Loaded(ok=[], reason="every block was cached locally", **report), []
        self.loads += 1
        try:
            peer = self._peer_of(spec.agent_name, spec.agent_metadata)
        except Exception as error:  # malformed or unusable metadata: nothing can be read
            return Loaded(ok=[False] * units, kept=0, reason=f"holder agent unusable: {error}", **report), \
                list(spec.local_block_ids)
        holder_size = spec.block_size or local.geometry.block_size
        tokens = spec.tokens if spec.tokens >= 0 else units * holder_size
        segments = token_segments(spec.remote_block_ids, holder_size, spec.local_block_ids,
                                  local.geometry.block_size, tokens)
        read = self._loader_loop.run_until_complete(read_units(
            [local], peer, segments, units, agent_name=spec.agent_name, remote_block_ids=spec.remote_block_ids,
            checksums=spec.checksums, faults=self._faults, retry=self._retry, timeout_s=self._timeout_s))
        local_ok = segments.destination_ok(read.ok, len(spec.local_block_ids))
        failed = [block_id for block_id, good in zip(spec.local_block_ids, local_ok) if not good]
        first_bad = local_ok.index(False) if False in local_ok else len(local_ok)
        kept = segments.units_ok([index < first_bad for index in range(len(local_ok))], units)
        if failed:
            log.warning("pull %s: %d of %d block(s) failed (%s); vLLM recomputes from the first",
                        spec.transfer_id, len(failed), len(local_ok), read.reason)
        return Loaded(ok=read.ok, nbytes=read.nbytes, duration_s=time.perf_counter() - started, reason=read.reason,
                      retried=read.retried, recovered=read.recovered,
                      kept=kept.index(False) if False in kept else units, **report), failed
