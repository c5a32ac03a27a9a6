"""What a reader trusts of the blocks it read: the same rules for every engine's data plane.

A block is sound only if its bytes landed (the transport said so) and their checksum is
the one the holder took when it pinned the block (CRC-32, carried in the `KvHandle` or in
`PushDone`): a block reused under an expired lease, or corrupted on the way, fails here
and is computed instead. Called by every pull's read (`connector.block_io.read_verified`,
both engines) and by the reader's end of a push (`connector.push_receipt.PushReceipt`,
both engines), each with its engine's `checksum` of a local block. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shared.schemas.transfer import PushDone


def verified_blocks(landed: Sequence[bool], local_block_ids: Sequence[int], expected_checksums: Sequence[int],
                    checksum: Callable[[int], int]) -> list[bool]:
    """Per block: it landed and its bytes match the holder's checksum (a missing checksum
    fails the block). Blocks that did not land are not checksummed."""
    return [bool(ok) and index < len(expected_checksums) and checksum(block_id) == expected_checksums[index]
            for index, (ok, block_id) in enumerate(zip(landed, local_block_ids))]


def pushed_blocks(message: PushDone, count: int) -> list[bool]:
    """Per target block of a push: its bytes landed, as the writer's `PushDone` says (every
    layer written). Not yet verified."""
    failed = set(message.failed_blocks)
    return [message.outcome in ("done", "failed") and index not in failed for index in range(count)]
