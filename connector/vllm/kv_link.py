"""The Tandem worker's end of its vLLM engine's KV connector (runs on the worker's loop).

`VllmEngine` owns one `ConnectorLink` when the connector is on. It is the only code in the
worker that talks to the connector's two sides in vLLM's processes:

- settings out: the `KVTransferConfig` naming the connector, its report endpoint and the
  NIXL agent's name (fresh per start, so readers notice a restarted engine);
- control requests: `pin_prefix` (lease a cached prefix) and `unpin`, and for a push's
  reader `allocate` (blocks for the writer) and `commit` (cache what verified), as
  pre-aborted vLLM requests, answered (pins) on the report socket;
- `collective_rpc` to the model worker: the agent's metadata, block checksums;
- reports in: `Pinned`, `Loaded` and `Pushed` resolve the futures waiting for them; each
  rank's `Loaded` and `Pushed` also carry its agent's transfer counters, of which the latest
  per rank are the load snapshot's (`rank_transfers`): the ranks are never asked for them.

Every wait is bounded by `control_timeout_s`; a report that arrives after its waiter gave
up is dropped (for a pin, the waiter has already asked for the unpin).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec
from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.engine import EngineCoreRequest

from connector.kv_checksums import Piece
from connector.kv_geometry import KvShape
from connector.kv_peer import KvPeer, encode_peer
from connector.vllm.kv_reports import ReportReceiver
from connector.vllm.kv_wire import (
    AllocOrder,
    CommitOrder,
    ControlOrder,
    ImagePlace,
    Loaded,
    Pinned,
    PinOrder,
    Pushed,
    RankAgent,
    RankChecksums,
    Report,
    UnpinOrder,
    control_params,
    merge_loaded,
    merge_pushed,
)
from connector.vllm.settings import KvConnectorOptions
from connector.vllm.tandem_connector import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    WORKER_EXTENSION,
    ConnectorSettings,
)
from shared.errors import Timeout, Unavailable
from shared.schemas.load import RankTransfers

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

R = TypeVar("R", Loaded, Pushed)
_rank_agents = msgspec.msgpack.Decoder(RankAgent)
_rank_checksums = msgspec.msgpack.Decoder(RankChecksums)


class AwaitedReports(Generic[R]):
    """Reports of one kind (`kind`), awaited by transfer id, each wait bounded by `timeout_s`.
    Every model-worker rank sends its own: the waiter gets them merged (`merge`) once all
    `ranks` came (set once the engine's ranks are known)."""

    def __init__(self, kind: str, timeout_s: float, merge: Callable[[list[R]], R]) -> None:
        self.kind = kind
        self.timeout_s = timeout_s
        self.ranks = 1
        self._merge = merge
        self._waiters: dict[str, asyncio.Future[R]] = {}
        self._parts: dict[str, list[R]] = {}

    def expect(self, transfer_id: str) -> asyncio.Future[R]:
        """Register before the request is added: the report may come before its first output."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[transfer_id] = waiter
        return waiter

    async def wait(self, transfer_id: str, waiter: asyncio.Future[R]) -> R | None:
        """The report, or None if none came within the timeout."""
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except TimeoutError:
            log.warning("no %s report for %s within %gs", self.kind, transfer_id, self.timeout_s)
            return None
        finally:
            self.forget(transfer_id)

    def forget(self, transfer_id: str) -> None:
        self._waiters.pop(transfer_id, None)
        self._parts.pop(transfer_id, None)

    def deliver(self, transfer_id: str, report: R) -> bool:
        """One rank's report; False when nobody waits for it (any more)."""
        waiter = self._waiters.get(transfer_id)
        if waiter is None or waiter.done():
            return False
        parts = self._parts.setdefault(transfer_id, [])
        parts.append(report)
        if len(parts) >= self.ranks:
            del self._parts[transfer_id]
            waiter.set_result(self._merge(parts))
        return True

    def cancel_all(self) -> None:
        for waiter in self._waiters.values():
            waiter.cancel()


class HeldBlocks(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request's prompt blocks, pinned in vLLM under `key`, with their checksums."""

    key: str
    block_ids: list[int]
    checksums: list[int]
    tail_tokens: int = 0  # non-zero: the last block is partial, with this many prompt tokens


class ConnectorLink:
    worker_extension = WORKER_EXTENSION

    def __init__(self, options: KvConnectorOptions, socket_dir: str) -> None:
        self.options = options
        self.agent_name = f"{options.agent_name_prefix}-{uuid.uuid4().hex[:8]}"
        self._receiver = ReportReceiver(f"ipc://{os.path.join(socket_dir, 'kv-reports')}", self._on_report)
        self._llm: AsyncLLM | None = None
        self._agent_metadata: bytes | None = None
        self._control_ids = itertools.count(1)
        self._control_prefix = f"tandem-ctl-{uuid.uuid4().hex[:8]}"
        self._pins: dict[str, asyncio.Future[Pinned]] = {}
        self.loads: AwaitedReports[Loaded] = AwaitedReports("load", options.control_timeout_s, merge_loaded)  # pulls
        self.pushes: AwaitedReports[Pushed] = AwaitedReports(  # writers
            "push", options.control_timeout_s, lambda parts: merge_pushed(parts, self.shape.num_kv_heads))
        self._shape: KvShape | None = None
        self._tasks: set[asyncio.Task] = set()
        self.late_reports = 0  # reports whose waiter had given up (or never existed)
        self._rank_transfers: dict[int, RankTransfers] = {}  # rank -> the counters of its latest report

    def transfer_config(self) -> KVTransferConfig:
        settings = ConnectorSettings(report_endpoint=self._receiver.endpoint, agent_name=self.agent_name,
                                     options=self.options)
        return KVTransferConfig(kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=msgspec.to_builtins(settings))

    @property
    def agent_metadata(self) -> bytes:
        assert self._agent_metadata is not None, "the connector link was not started"
        return self._agent_metadata

    def bind(self) -> None:
        """Before vLLM starts: its processes connect to the report socket as they come up."""
        self._receiver.start()

    @property
    def shape(self) -> KvShape:
        """The engine's KV, rank by rank, as its model workers describe it."""
        assert self._shape is not None, "the connector link was not started"
        return self._shape

    async def start(self, llm: AsyncLLM) -> None:
        """Ask every rank for its agent: this engine's `KvPeer`, what peers are told."""
        self._llm = llm
        ranks = sorted((_rank_agents.decode(payload) for payload in await self._rpc("tandem_agent_metadata")),
                       key=lambda rank: rank.geometry.rank)
        first = ranks[0].geometry
        self._shape = KvShape(block_size=first.block_size, num_layers=first.num_layers,
                              num_kv_heads=max(rank.geometry.heads.stop for rank in ranks),
                              ranks=[rank.geometry for rank in ranks])
        peer = KvPeer(agent_name=self.agent_name, shape=self._shape, rank_agents=[rank.agent_name for rank in ranks],
                      rank_metadata=[rank.metadata for rank in ranks])
        peer.validate()
        self._agent_metadata = encode_peer(peer)
        self.loads.ranks = self.pushes.ranks = len(ranks)

    async def stop(self) -> None:
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)
        await self._receiver.stop()
        for waiter in self._pins.values():
            waiter.cancel()
        self.loads.cancel_all()
        self.pushes.cancel_all()
        self._llm = None

    # ---- the model worker ----------------------------------------------------------------

    async def checksums(self, units: list[list[Piece]]) -> list[int]:
        """The units' checksums over every KV head (each head from a rank that holds it),
        flat: unit by unit, head by head (`connector.kv_checksums`)."""
        heads = self.shape.num_kv_heads
        flat = [0] * (len(units) * heads)
        for payload in await self._rpc("tandem_checksums", [[list(piece) for piece in unit] for unit in units]):
            part = _rank_checksums.decode(payload)
            width = len(part.heads)
            for unit in range(len(units)):
                for column, head in enumerate(part.heads):
                    flat[unit * heads + head] = part.values[unit * width + column]
        return flat

    async def block_checksums(self, block_ids: list[int]) -> list[int]:
        """Whole blocks' checksums (a partial tail block's too: it is read whole)."""
        size = self.shape.block_size
        return await self.checksums([[(block_id, 0, size)] for block_id in block_ids])

    async def _rpc(self, method: str, *args: object) -> list:
        llm = self._require_llm()
        timeout = self.options.control_timeout_s
        try:
            # The bound is ours, not vLLM's: a multi-process engine whose ranks answer after
            # its own collective_rpc timeout leaves their late answers in its response queue,
            # where the next step reads them as its output (the engine then fails, or a rank
            # waits in an all-reduce forever). Unbounded there, the call ends between steps.
            return await asyncio.wait_for(llm.collective_rpc(method, args=args), timeout)
        except TimeoutError:
            raise Timeout(f"vLLM's model worker did not answer {method} within {timeout:g}s") from None

    # ---- the scheduler -------------------------------------------------------------------

    async def pin_prefix(self, key: str, token_ids: list[int], block_hashes: Sequence[int] = ()) -> list[int]:
        """Pin the longest cached prefix of the blocks `block_hashes` names (vLLM's own, as its
        events give them), or of `token_ids`, under `key`: its block ids (maybe none). On
        timeout the pin is undone (`unpin` is idempotent) and Timeout raised."""
        return await self._pinning(PinOrder(key=key, block_hashes=list(block_hashes)), key, token_ids)

    async def allocate(self, key: str, count: int) -> list[int]:
        """A push's reader: `count` fresh blocks pinned under `key` (none if the pool cannot
        spare them). On timeout the pin is undone and Timeout raised."""
        return await self._pinning(AllocOrder(key=key, count=count), key, [0])

    async def commit(self, key: str, count: int, token_ids: list[int], images: Sequence[ImagePlace] = (),
                     cache_salt: str = "", keep_next: bool = False) -> list[int]:
        """A push's reader: cache the first `count` blocks under `key` as the prompt
        `token_ids`' full blocks, hashed with its `images` and `cache_salt` (still pinned),
        unpin the rest, but for the last where it is the next and `keep_next` (a partial last
        block, pinned uncached); the cached block ids, then that one where kept."""
        return await self._pinning(CommitOrder(key=key, count=count, images=list(images), keep_next=keep_next), key,
                                   token_ids, cache_salt)

    async def _pinning(self, order: ControlOrder, key: str, token_ids: list[int], cache_salt: str = "") -> list[int]:
        waiter = asyncio.get_running_loop().create_future()
        self._pins[key] = waiter
        try:
            await self._control(order, token_ids, cache_salt)
            pinned = await asyncio.wait_for(asyncio.shield(waiter), self.options.control_timeout_s)
        except BaseException:
            self.unpin_soon([key])
            raise
        finally:
            self._pins.pop(key, None)
        return pinned.block_ids

    async def unpin(self, keys: list[str]) -> None:
        if keys:
            await self._control(UnpinOrder(keys=list(keys)), [0])

    def unpin_soon(self, keys: list[str]) -> None:
        """Unpin from synchronous code (lease ends, cancellations); ordered after every control
        request already sent, so an unpin never overtakes its pin."""
        if keys and self._llm is not None:
            task = asyncio.ensure_future(self.unpin(keys))
            self._tasks.add(task)
            task.add_done_callback(self._unpinned)

    def _unpinned(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("unpinning KV blocks failed (the engine is gone?): %s", task.exception())

    async def _control(self, order: ControlOrder, token_ids: list[int], cache_salt: str = "") -> None:
        """A pre-aborted request: vLLM hands it to the connector's `on_new_request`, then aborts
        it without scheduling it (what `AsyncLLM.notify_kv_transfer_request_rejected` does).
        `cache_salt`: a commit's, so that vLLM hashes its blocks as the request's own."""
        llm = self._require_llm()
        request = EngineCoreRequest(
            request_id=f"{self._control_prefix}-{next(self._control_ids)}", prompt_token_ids=list(token_ids),
            mm_features=None,
            sampling_params=VllmSamplingParams(max_tokens=1, extra_args={"kv_transfer_params": control_params(order)}),
            pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=cache_salt or None,
            data_parallel_rank=None, abort_immediately=True)
        await llm.engine_core.add_request_async(request)

    # ---- reports -------------------------------------------------------------------------

    def rank_transfers(self) -> list[RankTransfers]:
        """Each rank's agent's transfer counters, by rank, from its latest `Loaded` or `Pushed`;
        never waits. Every rank of the shape has its entry, as the sim's ranks do: one not heard
        from yet has zero counters (each of its pulls and pushes ends in a report, so it moved
        nothing, or that report is still on its way). No entries before `start`."""
        if self._shape is None:
            return []
        return [self._rank_transfers.get(rank.rank, RankTransfers(rank=rank.rank)) for rank in self._shape.ranks]

    def _on_report(self, report: Report) -> None:
        if isinstance(report, Loaded | Pushed) and report.transfers is not None:
            self._rank_transfers[report.transfers.rank] = report.transfers
        match report:
            case Pinned(key=key):
                waiter = self._pins.get(key)
            case Loaded(transfer_id=transfer_id):
                self._delivered(self.loads.deliver(transfer_id, report), report)
                return
            case Pushed(transfer_id=transfer_id):
                self._delivered(self.pushes.deliver(transfer_id, report), report)
                return
        if waiter is None or waiter.done():
            self._delivered(False, report)
            return
        waiter.set_result(report)

    def _delivered(self, taken: bool, report: Report) -> None:
        if not taken:
            self.late_reports += 1
            log.info("KV connector report nobody waits for: %r", report)

    def _require_llm(self) -> AsyncLLM:
        if self._llm is None:
            raise Unavailable("the vLLM engine is not running")
        return self._llm
