"""The port a vLLM engine implements for Tandem's vLLM data plane: `VllmKvEngine`.

vLLM's KV cache lives in its own processes, so this port is narrower than
`connector.port.KvPort`: the data plane (`worker_kv.VllmWorkerKv`, `holder.VllmKvHolder`)
stages a `TransferOrder` for a request id, takes the blocks a finished hold request pinned,
asks which tokens a cached prefix covers, and talks to the connector's two sides through
the engine's `kv_link.ConnectorLink`. Implemented by `services/worker/vllm/engine.py`
(`VllmEngine`); every method runs on the worker's event loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from connector.vllm.kv_wire import Loaded, TransferOrder

if TYPE_CHECKING:
    from connector.vllm.kv_link import ConnectorLink, HeldBlocks

LoadCallback = Callable[[Loaded | None, str], None]
"""`on_loaded(report, why_none)`: a staged pull's outcome, called once on the loop thread before
the request's first output, or when it ends without one (report None: "cancelled", or "no
load report" when the connector's report did not come in time)."""


@dataclass(frozen=True, slots=True)
class StagedTransfer:
    order: TransferOrder
    on_loaded: LoadCallback | None = None


class VllmKvEngine(Protocol):
    @property
    def kv_link(self) -> ConnectorLink:
        """This process's end of the connector (pins, checksums, the NIXL agent's name)."""
        ...

    def stage(self, request_id: str, order: TransferOrder, on_loaded: LoadCallback | None = None) -> None:
        """Attach `order` to the next `generate(request_id, ...)`; a pull needs `on_loaded`."""
        ...

    def unstage(self, request_id: str) -> StagedTransfer | None:
        """Take back an order `generate()` never picked up (the request failed before it ran)."""
        ...

    def take_held(self, request_id: str) -> HeldBlocks | None:
        """The prompt blocks vLLM pinned for a finished hold request; from then on the caller
        owns the pin (`kv_link.unpin_soon([held.key])`). Called before the stream closes."""
        ...

    def prefix_tokens(self, block_hashes: list[int]) -> list[int]:
        """The tokens of the longest prefix of `block_hashes` the engine's KV events say is
        cached (they may lag: vLLM pins what really is)."""
        ...

    def prefix_blocks(self, block_hashes: list[int]) -> list[int]:
        """vLLM's own hashes (its KV events' form) of that prefix's blocks, which take in the
        images, adapter and salt each was computed with."""
        ...
