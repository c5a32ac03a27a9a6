"""What crosses vLLM's process boundaries for Tandem's KV connector (pure data, no vLLM import).

Three processes take part (see `tandem_connector` for the whole picture): the Tandem worker
(AsyncLLM), vLLM's EngineCore (the connector's scheduler side) and the model worker (the
connector's worker side, with the KV cache and the NIXL agent).

- in, with a generate request: a `TransferOrder` in vLLM's `kv_transfer_params` (hold the
  prompt's blocks when it finishes; pull blocks from a holder before computing);
- in, as a control request (a pre-aborted vLLM request: it reaches the scheduler side's
  `on_new_request` without being scheduled): `PinOrder` / `UnpinOrder`;
- out, with the final output: `Held` (the pinned prompt blocks) in `kv_transfer_params`;
- out, on the report socket (ZMQ PUSH -> the worker's PULL): `Pinned`, `Loaded`;
- scheduler side -> worker side, in the step's connector metadata: `LoadSpec`.

Schema evolution: new fields get defaults; types never change.
"""

from __future__ import annotations

from typing import Any

import msgspec

ORDER_KEY = "tandem"  # kv_transfer_params key of a generate request's order
CONTROL_KEY = "tandem_control"  # kv_transfer_params key of a control request
HELD_KEY = "tandem_held"  # kv_transfer_params key of the final output's held blocks


class PullOrder(msgspec.Struct, frozen=True, kw_only=True):
    """Read these blocks of a holder's pool instead of computing them (token order)."""

    lease_id: str
    agent_name: str
    agent_metadata: bytes  # the holder's NIXL agent metadata (added once per agent name)
    block_ids: list[int]
    checksums: list[int]  # CRC-32 per block, computed by the holder when it granted the lease


class TransferOrder(msgspec.Struct, frozen=True, kw_only=True):
    transfer_id: str  # Tandem's request id: vLLM renames requests internally
    hold_key: str = ""  # non-empty: pin the prompt's full blocks under this key when it finishes
    pull: PullOrder | None = None


class PinOrder(msgspec.Struct, frozen=True, kw_only=True, tag="pin"):
    """Pin the longest cached prefix of the control request's own prompt under `key`."""

    key: str


class UnpinOrder(msgspec.Struct, frozen=True, kw_only=True, tag="unpin"):
    keys: list[str]  # unknown keys are ignored: unpinning is idempotent


ControlOrder = PinOrder | UnpinOrder


class Held(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    block_ids: list[int]  # the prompt's full blocks, in token order


class Pinned(msgspec.Struct, frozen=True, kw_only=True, tag="pinned"):
    key: str
    block_ids: list[int]  # the longest cached prefix, possibly empty


class Loaded(msgspec.Struct, frozen=True, kw_only=True, tag="loaded"):
    """The one outcome of a pull, sent by the worker side in the step that loaded it."""

    transfer_id: str
    lease_id: str
    cached_blocks: int  # leading blocks of the order found in the local prefix cache (not read)
    ok: list[bool]  # per block read (those after `cached_blocks`): arrived and verified
    nbytes: int = 0
    duration_s: float = 0.0
    reason: str = ""
    retried: int = 0  # blocks read again after a failed read or verification
    recovered: int = 0  # of those, blocks that then arrived and verified (counted in `ok`)

    @property
    def used_blocks(self) -> int:
        """Blocks vLLM keeps: its computed prefix cannot have holes, so it recomputes
        everything from the first failed block on."""
        return self.ok.index(False) if False in self.ok else len(self.ok)


Report = Pinned | Loaded


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One pull for the worker side to perform in this step (vLLM's asynchronous load: the
    request waits for it, unscheduled, and is reported finished once it is done)."""

    request_id: str  # vLLM's (internal) request id
    transfer_id: str
    lease_id: str
    agent_name: str
    agent_metadata: bytes
    remote_block_ids: list[int]
    local_block_ids: list[int]
    checksums: list[int]
    cached_blocks: int


# ---- kv_transfer_params helpers -----------------------------------------------------------

def order_params(order: TransferOrder) -> dict[str, Any]:
    return {ORDER_KEY: msgspec.to_builtins(order)}


def control_params(order: ControlOrder) -> dict[str, Any]:
    return {CONTROL_KEY: msgspec.to_builtins(order)}


def held_params(held: Held) -> dict[str, Any]:
    return {HELD_KEY: msgspec.to_builtins(held)}


def _converted(params: dict[str, Any] | None, key: str, kind: Any) -> Any:
    if not params or key not in params:
        return None
    # bytes stay bytes through vLLM's msgpack; to_builtins/convert keep them as is.
    return msgspec.convert(params[key], kind)


def order_of(params: dict[str, Any] | None) -> TransferOrder | None:
    return _converted(params, ORDER_KEY, TransferOrder)


def control_of(params: dict[str, Any] | None) -> ControlOrder | None:
    return _converted(params, CONTROL_KEY, ControlOrder)


def held_of(params: dict[str, Any] | None) -> Held | None:
    return _converted(params, HELD_KEY, Held)


_report_encoder = msgspec.msgpack.Encoder()
_report_decoder = msgspec.msgpack.Decoder(Report)


def encode_report(report: Report) -> bytes:
    return _report_encoder.encode(report)


def decode_report(payload: bytes) -> Report:
    return _report_decoder.decode(payload)
