"""The reader's end of one push, written once for every engine (pure: no I/O, the time
passed in): what the writer's `PushDone` says landed, what verified against its checksums,
what the engine committed, and the push's `TransferRecord`.

Drivers, after the shared wait (`connector.push.wait_for_push`): the sim's
`connector.sim.worker_kv.WorkerKv` verifies with its port's checksums and commits every
verified block (`connector.push.PushReceiver`); vLLM's `connector.vllm.push.VllmPush`
checksums the blocks in the model worker and caches the leading verified ones (its
computed prefix cannot have holes). Either way: `verify(checksum)`, then `committed(flags)`,
then `record()`, `span_attributes()`, `fill(prepared)`, `log_failures()`.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass, field

from connector.block_reader import pushed_blocks
from connector.prepared import Prepared
from connector.spans import block_failures
from shared.schemas.transfer import PushDone, TransferRecord

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PushReceipt:
    """One push as the reader saw it, from the writer's `PushDone` to its record."""

    worker_id: str
    request_id: str
    message: PushDone
    target_block_ids: list[int]
    _: KW_ONLY
    block_size: int
    block_nbytes: int  # one block, every layer (0 if unknown)
    started: float
    prompt_tokens: int = 0  # the prompt's: its partial last block, where targeted, counts its tokens (0: all full)
    landed: list[bool] = field(init=False)  # the writer says: every layer written
    ok: list[bool] | None = field(init=False, default=None)  # landed and verified
    committed_ok: list[bool] | None = field(init=False, default=None)  # taken by the engine
    ended_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.landed = pushed_blocks(self.message, len(self.target_block_ids))
        self.ended_at = self.started

    @property
    def blocks(self) -> int:
        return len(self.target_block_ids)

    def verify(self, checksums: list[int]) -> list[bool]:
        """Per target block: landed, and the reader's checksums of it (flat, block by block,
        head by head) are the writer's."""
        heads = len(checksums) // self.blocks if self.blocks else 0
        expected = self.message.checksums
        self.ok = [bool(landed) and len(expected) == len(checksums) and
                   checksums[index * heads:(index + 1) * heads] == expected[index * heads:(index + 1) * heads]
                   for index, landed in enumerate(self.landed)]
        return self.ok

    def committed(self, flags: list[bool], now: float) -> None:
        assert self.ok is not None and len(flags) == self.blocks, "commit what was verified"
        self.committed_ok, self.ended_at = list(flags), now

    @property
    def blocks_ok(self) -> int:
        return sum(self.committed_ok or [])

    @property
    def failed_blocks(self) -> list[int]:
        """Target blocks not committed: computed instead."""
        committed = self.committed_ok or [False] * self.blocks
        return [index for index, ok in enumerate(committed) if not ok]

    @property
    def reason(self) -> str:
        if not self.failed_blocks:
            return ""
        not_written = sum(not landed for landed in self.landed)
        bad = sum(not ok for ok in self.ok or [False] * self.blocks)
        reason = f"{not_written} block(s) not written, {bad - not_written} did not verify"
        unused = len(self.failed_blocks) - bad  # sound, but not committed (vLLM: after a failed block)
        return f"{reason}, {unused} sound but not kept" if unused else reason

    def tokens(self, indices: list[int]) -> int:
        """The prompt tokens of these target blocks."""
        if not self.prompt_tokens:
            return len(indices) * self.block_size
        return sum(max(0, min(self.block_size, self.prompt_tokens - index * self.block_size)) for index in indices)

    def record(self) -> TransferRecord:
        blocks_ok, recomputed = self.blocks_ok, self.blocks - self.blocks_ok
        failed = self.failed_blocks
        return TransferRecord(worker_id=self.worker_id, request_id=self.request_id, kind="push", peer_worker_id="",
                              outcome="failed" if recomputed else "done", blocks=self.blocks, blocks_ok=blocks_ok,
                              bytes=blocks_ok * self.block_nbytes, duration_s=self.ended_at - self.started,
                              pulled_tokens=self.tokens(self._committed_indices()),
                              recomputed_tokens=self.tokens(failed), reason=self.reason)

    def _committed_indices(self) -> list[int]:
        return [index for index, ok in enumerate(self.committed_ok or []) if ok]

    def span_attributes(self) -> dict[str, list[int] | int]:
        """The `kv.push.receive` span's block figures: not written, and written but corrupt."""
        return block_failures(self.landed, self.ok or [False] * self.blocks)

    def fill(self, prepared: Prepared) -> None:
        recomputed = self.blocks - self.blocks_ok
        prepared.pulled_tokens = self.tokens(self._committed_indices())
        prepared.recomputed_tokens, prepared.recomputed_blocks = self.tokens(self.failed_blocks), recomputed
        prepared.retried_blocks = prepared.recovered_blocks = 0

    def log_failures(self) -> None:
        failed = self.failed_blocks
        if failed:
            log.warning("%s: push of %s: %d of %d block(s) failed (%s); they are computed", self.worker_id,
                        self.request_id, len(failed), self.blocks, self.reason)
