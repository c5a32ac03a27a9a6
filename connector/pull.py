"""One pull of a holder's blocks, from its lease to its record: the state machine of the
reader's side, written once for every engine (pure: no I/O, the time passed in).

A pull is driven through these steps; its data plane does the I/O between them:

1. `Pull.begin(...)`: which of the handle's blocks the prompt can use (`wanted`: its full
   blocks, and the holder's partial tail block where the engine takes one).
2. `skip(n)`: the leading `n` wanted blocks are cached here already (not read).
3. How the read ended, exactly once: `landed(read)` (per block: arrived and verified, as
   `connector.block_io.read_verified` reports it), `nothing_arrived(reason)` (the holder's
   agent unreachable, or the engine lost the read), `nothing_to_read()`, `no_free_blocks()`,
   or `cancelled()` (the request went away: nothing was read, nothing is computed for it).
4. `release()`: the outcome (and failed blocks) the lease is released with;
   `released(held)`: the holder's answer. A lease that had already expired means the blocks
   may have been reused while they were read: blocks not committed yet are then never
   used (`usable()` says none is); blocks already committed stay (each was verified against
   the checksum the holder took when it pinned it, after the copy, so a block reused in
   between failed and is computed), and the record says "expired" either way.
5. `committed(flags)`: per block read, whether the engine took it into its prefix cache;
   the others are computed.
6. `record(now)`, `span_attributes()`, `fill(prepared)`, `log_failures()`: the outcome.

Drivers: the sim's `connector.puller.KvPuller` reads in-process, releases, then commits
what is still usable (steps in order). vLLM's `connector.vllm.worker_kv.VllmWorkerKv`
stages the read with the engine, which reads and commits in the request's first step (its
computed prefix cannot have holes: every block from the first failed one on is computed)
and reports `Loaded`; it then releases the lease (step 5 before step 4).
"""

from __future__ import annotations

import logging

from connector.block_io import VerifiedRead
from connector.dataplane import Prepared
from connector.spans import block_failures
from shared.schemas.transfer import KvHandle, TransferKind, TransferOutcome, TransferRecord

log = logging.getLogger(__name__)

EXPIRED_UNUSED = "lease expired before the pull ended"  # the read blocks were not used
EXPIRED_USED = "lease expired"  # after the engine took the verified blocks


class Pull:
    """One pull, from the blocks it wants to its `TransferRecord`."""

    def __init__(self, worker_id: str, request_id: str, handle: KvHandle, kind: TransferKind, *, full_blocks: int,
                 tail_tokens: int, started: float) -> None:
        self.worker_id = worker_id
        self.request_id = request_id
        self.handle = handle
        self.kind = kind
        self.full_blocks = full_blocks  # the handle's full blocks the prompt covers
        self.tail_tokens = tail_tokens  # non-zero: the handle's partial tail block is wanted too
        self.wanted = full_blocks + bool(tail_tokens)
        self.started = started
        self.first = 0  # leading wanted blocks cached here (not read)
        self.blocks = self.wanted  # blocks the pull covers after those (the engine may ask fewer)
        self.read: VerifiedRead | None = None  # how the read ended; None: nothing was read
        self.ended_as: TransferOutcome | None = None  # an end without a read: "done" or "cancelled"
        self.reason = ""
        self.recompute_unread = True  # the blocks not committed are computed (not so once cancelled)
        self.expired = False  # the holder said the lease had ended before the release
        self.committed_ok: list[bool] | None = None  # per block read: taken by the engine
        self.ended_at = started

    @classmethod
    def begin(cls, worker_id: str, request_id: str, handle: KvHandle, kind: TransferKind, prompt_tokens: int, *,
              takes_tail: bool, started: float) -> Pull:
        """The blocks the prompt can use. The tail block only follows all the full blocks,
        for a prompt that goes on past it (vLLM computes at least its last token)."""
        block_size = handle.block_size
        full = min(len(handle.block_ids), prompt_tokens // block_size)
        tail = handle.tail
        tail_tokens = tail.tokens if takes_tail and tail is not None and full == len(handle.block_ids) and (
            prompt_tokens >= full * block_size + tail.tokens) else 0
        return cls(worker_id, request_id, handle, kind, full_blocks=full, tail_tokens=tail_tokens, started=started)

    @property
    def block_size(self) -> int:
        return self.handle.block_size

    @property
    def remote_block_ids(self) -> list[int]:
        """The holder's blocks to read, after the ones cached here."""
        block_ids = list(self.handle.block_ids[:self.full_blocks])
        if self.tail_tokens and self.handle.tail is not None:
            block_ids.append(self.handle.tail.block_id)
        return block_ids[self.first:self.wanted]

    @property
    def heads(self) -> int:
        """KV heads per block in the handle's checksums (`connector.kv_checksums`); a handle of
        a prompt shorter than a block has its tail's only."""
        handle = self.handle
        if handle.block_ids:
            return len(handle.checksums) // len(handle.block_ids)
        return len(handle.tail.checksums) if handle.tail is not None else 0

    @property
    def checksums(self) -> list[int]:
        """The checksums of the blocks to read, block by block, head by head."""
        heads = self.heads
        checksums = list(self.handle.checksums[:self.full_blocks * heads])
        if self.tail_tokens and self.handle.tail is not None:
            checksums += self.handle.tail.checksums
        return checksums[self.first * heads:self.wanted * heads]

    # ---- steps ------------------------------------------------------------------------

    def skip(self, cached: int) -> None:
        self.first = min(cached, self.wanted)
        self.blocks = self.wanted - self.first

    def narrow(self, first: int, blocks: int) -> None:
        """Read `blocks` blocks from block `first` on (a reader of another block size takes
        whole blocks of its own: `connector.token_map.aligned_span`); the rest of the wanted
        blocks is neither read nor counted."""
        assert 0 <= first and first + blocks <= self.wanted
        if first + blocks <= self.full_blocks:
            self.tail_tokens = 0
        self.first, self.blocks, self.wanted = first, blocks, first + blocks

    def nothing_to_read(self, now: float) -> None:
        self._end(now, "done", "no full block of the prompt" if self.full_blocks == 0 else "already cached")
        self.blocks = 0

    def no_free_blocks(self, now: float) -> None:
        """The engine cannot spare blocks to read into: it computes them all."""
        self._end(now, "cancelled", "no free blocks")

    def cancelled(self, now: float, reason: str = "cancelled") -> None:
        """The request went away before its read was used: nothing to count as computed."""
        self._end(now, "cancelled", reason)
        self.recompute_unread = False

    def nothing_arrived(self, now: float, reason: str) -> None:
        self.landed(VerifiedRead(landed=[False] * self.blocks, first_ok=[False] * self.blocks,
                                 ok=[False] * self.blocks, nbytes=0, reason=reason, retried=0, recovered=0), now)

    def landed(self, read: VerifiedRead, now: float) -> None:
        assert self.read is None and self.ended_as is None, "a pull ends once"
        self.read, self.blocks, self.reason, self.ended_at = read, len(read.ok), read.reason, now

    def release(self) -> tuple[TransferOutcome, list[int]]:
        """The outcome the lease is released with, and the failed blocks (indices into the handle)."""
        if self.read is None:
            assert self.ended_as is not None, "release after the read ended"
            return self.ended_as, []
        failed = [self.first + index for index, ok in enumerate(self.read.ok) if not ok]
        return ("failed" if failed else "done"), failed

    def released(self, held: bool | None) -> None:
        """The holder's answer to the release: False if the lease had already ended. (None,
        no answer: the lease was ours until its expiry frees the blocks.)"""
        if held is not False or self.read is None:
            return
        self.expired = True
        log.warning("%s: lease %s on %s had expired when %s released it (%s)", self.worker_id, self.handle.lease_id,
                    self.handle.holder_worker_id, self.request_id,
                    "its blocks were in use" if self.committed_ok is not None else "its blocks are not used")
        if self.committed_ok is None:
            self.reason = EXPIRED_UNUSED
        else:
            self.reason = self.reason or EXPIRED_USED

    def usable(self) -> list[bool]:
        """Per block read, whether it may be committed: sound, and its lease not expired."""
        assert self.read is not None
        return [ok and not self.expired for ok in self.read.ok]

    def committed(self, flags: list[bool]) -> None:
        assert self.read is not None and len(flags) == len(self.read.ok)
        self.committed_ok = list(flags)

    def _end(self, now: float, outcome: TransferOutcome, reason: str) -> None:
        assert self.read is None and self.ended_as is None, "a pull ends once"
        self.ended_as, self.reason, self.ended_at = outcome, reason, now

    # ---- the outcome ------------------------------------------------------------------

    @property
    def blocks_ok(self) -> int:
        return sum(self.committed_ok) if self.committed_ok is not None else 0

    @property
    def blocks_recomputed(self) -> int:
        return self.blocks - self.blocks_ok if self.recompute_unread else 0

    @property
    def failed_blocks(self) -> list[int]:
        """Blocks read but not committed (indices into the handle): computed instead."""
        if self.read is None:
            return []
        committed = self.committed_ok or [False] * len(self.read.ok)
        return [self.first + index for index, ok in enumerate(committed) if not ok]

    @property
    def outcome(self) -> TransferOutcome:
        if self.ended_as is not None:
            return self.ended_as
        if self.expired:
            return "expired"
        return "failed" if self.failed_blocks else "done"

    def tokens(self, blocks: int, *, after: int) -> int:
        """Prompt tokens in `blocks` wanted blocks from block `after` on."""
        tokens = blocks * self.block_size
        if self.tail_tokens and blocks and after + blocks == self.wanted:
            tokens -= self.block_size - self.tail_tokens
        return tokens

    @property
    def pulled_tokens(self) -> int:
        return self.tokens(self.blocks_ok, after=self.first)

    @property
    def recomputed_tokens(self) -> int:
        return self.tokens(self.blocks_recomputed, after=self.first + self.blocks_ok)

    def record(self) -> TransferRecord:
        read = self.read
        failed = self.failed_blocks
        reason = self.reason or (f"{len(failed)} block(s) failed verification" if failed else "")
        return TransferRecord(worker_id=self.worker_id, request_id=self.request_id, kind=self.kind,
                              peer_worker_id=self.handle.holder_worker_id, outcome=self.outcome, blocks=self.blocks,
                              blocks_ok=self.blocks_ok, bytes=read.nbytes if read else 0,
                              duration_s=self.ended_at - self.started, pulled_tokens=self.pulled_tokens,
                              recomputed_tokens=self.recomputed_tokens, reason=reason,
                              blocks_retried=read.retried if read else 0,
                              blocks_recovered=read.recovered if read else 0)

    def span_attributes(self) -> dict[str, list[int] | int]:
        """The `kv.pull` span's block figures (with `connector.spans.transfer_attributes`)."""
        read = self.read or VerifiedRead(landed=[], first_ok=[], ok=[], nbytes=0, reason="", retried=0, recovered=0)
        return {**block_failures(read.landed, read.first_ok, self.first), "tandem.kv.blocks_retried": read.retried,
                "tandem.kv.blocks_recovered": read.recovered}

    def fill(self, prepared: Prepared) -> None:
        """The pull's counts, for the request and the worker's load snapshot."""
        prepared.pulled_tokens, prepared.recomputed_tokens = self.pulled_tokens, self.recomputed_tokens
        prepared.recomputed_blocks = self.blocks_recomputed
        prepared.retried_blocks = self.read.retried if self.read else 0
        prepared.recovered_blocks = self.read.recovered if self.read else 0

    def log_failures(self) -> None:
        failed = self.failed_blocks
        if failed:
            log.warning("%s: %s of %s from %s: %d of %d block(s) failed (%s); they are computed", self.worker_id,
                        self.kind, self.request_id, self.handle.holder_worker_id, len(failed), self.blocks,
                        self.reason or "verification")
