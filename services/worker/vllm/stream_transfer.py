"""One generate stream's part in a KV transfer: what `engine.VllmEngine`'s stream does, around
vLLM's outputs, for the `TransferOrder` staged for its request (the cases are listed in
`engine`'s docstring: a pull, a hold, a push's reader; a push's writer needs nothing here).

Caller: `VllmEngine._stream`, which makes one `StreamTransfer` per stream that took a staged
order, right before it adds the request to vLLM, calls `on_output` for every output of vLLM's,
`on_finished` for the final one, and `end` however the stream ends. The connector is reached
through the engine's port (`connector.vllm.engine_port.VllmKvEngine.kv_link`), read at each
use; everything runs on the worker's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from connector.vllm.engine_port import StagedTransfer, VllmKvEngine
from connector.vllm.kv_link import HeldBlocks
from connector.vllm.kv_wire import Loaded, held_of
from shared.errors import TandemError
from shared.schemas.generate import FinishReason

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

log = logging.getLogger(__name__)


class StreamTransfer:
    def __init__(self, engine: VllmKvEngine, request_id: str, staged: StagedTransfer,
                 held: dict[str, HeldBlocks]) -> None:
        """`held`: the engine's blocks held for `take_held()`, by request id."""
        self._engine = engine
        self._request_id = request_id
        self._staged = staged
        self._held = held
        order = staged.order
        # Registered before the request is added: the report can overtake the first output.
        self._load_waiter: asyncio.Future[Loaded] | None = \
            engine.kv_link.loads.expect(order.transfer_id) if order.pull else None
        self._release_key = order.release_key
        self._hold_settled = False  # the final output's held blocks are stored, or there were none

    async def on_output(self) -> None:
        """Before an output of vLLM's leaves: the first one means the request was admitted (a
        pushed prefix is held by its cache hit now) and its pull's outcome is due."""
        if self._release_key:  # admitted: its prefix-cache hit holds the pushed blocks now
            self._engine.kv_link.unpin_soon([self._release_key])
            self._release_key = ""
        if self._load_waiter is not None:
            on_loaded = self._staged.on_loaded
            assert on_loaded is not None
            report = await self._engine.kv_link.loads.wait(self._staged.order.transfer_id, self._load_waiter)
            self._load_waiter = None
            on_loaded(report, "" if report is not None else "no load report")

    async def on_finished(self, output: RequestOutput, finish_reason: FinishReason | None) -> None:
        """The final output: a hold request's pinned blocks are kept for `take_held()`."""
        if self._staged.order.hold_key:
            await self._keep_held(output)
        # An abort can race a finish that vLLM's scheduler saw first (and pinned).
        self._hold_settled = finish_reason != "abort"

    def end(self) -> None:
        """Let go of what the stream still holds when it ends, however it ends (after vLLM's
        request ended): the pushed blocks' pin if never admitted, the load waiter if no output
        came, the held blocks' pin if not taken or not settled."""
        order = self._staged.order
        if self._release_key:
            self._engine.kv_link.unpin_soon([self._release_key])
        if self._load_waiter is not None:  # ended before its first output: the pull never ran here
            assert self._staged.on_loaded is not None
            self._engine.kv_link.loads.forget(order.transfer_id)
            self._staged.on_loaded(None, "cancelled")
        if order.hold_key:
            # Not taken by take_held(), or the request ended before its held blocks were
            # stored while vLLM may have pinned them: unpinning an unknown key is a no-op.
            if self._held.pop(self._request_id, None) is not None or not self._hold_settled:
                self._engine.kv_link.unpin_soon([order.hold_key])

    async def _keep_held(self, output: RequestOutput) -> None:
        """Checksum the blocks vLLM pinned for a finished hold request, for `take_held()`."""
        held = held_of(output.kv_transfer_params)
        if held is None:
            return  # aborted (or not holdable): vLLM pinned nothing
        try:
            checksums = await self._engine.kv_link.block_checksums(held.block_ids)  # the tail's whole block too
        except TandemError as error:
            log.warning("not holding the blocks of %s: %s", self._request_id, error)
            self._engine.kv_link.unpin_soon([held.key])
            return
        self._held[self._request_id] = HeldBlocks(key=held.key, block_ids=held.block_ids, checksums=checksums,
                                                  tail_tokens=held.tail_tokens)
