"""One `BlockStored` event into the KV index (`index`): its Tandem chain, taken as the worker
sent it, hashed here from its token ids (and the image salts of blocks that hold images) or
verified against them (`KvIndex.verify_hashes`), then its blocks inserted into the holder
masks and the worker's tables. Pure and synchronous.

Caller: `KvIndex.ingest`, once per `BlockStored` of a batch that is not applied as a
snapshot's difference. The counts it returns feed `IngestResult`.
"""

from __future__ import annotations

from itertools import repeat
from operator import and_, ne

from services.router.kv.index_worker import IndexedWorker
from shared.block_hash import chain_root, packed_block_hash_chain
from shared.schemas.kv_events import BlockStored, BlockStoredWithoutTokens, packed_token_ids_of
from shared.token_pack import TOKEN_BYTES


def store_event(worker: IndexedWorker, holders: dict[int, int], event: BlockStored | BlockStoredWithoutTokens,
                verify_hashes: bool) -> tuple[int, int, int, bool, int]:
    """Apply one `BlockStored` of `worker` (`verify_hashes`: `KvIndex.verify_hashes`); returns
    block counts (stored, rejected, orphaned), whether its parent was unknown, and how many
    worker-sent chain hashes verification refuted."""
    engine_hashes = event.block_hashes
    blocks = len(engine_hashes)
    chain = event.chain_hashes
    size = worker.block_size
    if chain is not None and len(chain) != blocks:
        chain = None  # malformed: fall back to the token ids, if they fit
    # The token ids are read only to hash or verify the chain here: an event whose chain is
    # indexed as sent may come without them (`batch_decode` skips them on the wire).
    packed = _packed_or_none(event) if chain is None or verify_hashes else None
    salts = event.image_salts
    tokens_fit = packed is not None and len(packed) == blocks * size * TOKEN_BYTES and (
        salts is None or len(salts) == blocks)
    hashed_here = chain is None or tokens_fit  # verification without fitting token ids: as sent
    if event.block_size != size or (chain is None and not tokens_fit):
        worker.rejected_blocks += blocks
        return 0, blocks, 0, False, 0
    if not blocks:
        return 0, 0, 0, False, 0
    head, parent_hash, unlinked = _new_blocks_start(worker.tandem_of, event)
    if head == blocks:
        return 0, 0, 0, False, 0
    if head:
        engine_hashes = engine_hashes[head:]
    mismatched = 0
    if hashed_here:
        assert packed is not None  # hashed here: the token ids fit
        if parent_hash is None:  # the chain cannot be computed without the parent's hash
            worker.orphaned_blocks += blocks
            return 0, 0, blocks, True, 0
        tandem = packed_block_hash_chain(packed[head * size * TOKEN_BYTES:] if head else packed, size,
                                         parent_hash=parent_hash, salt=worker.salt,
                                         block_salts=(salts[head:] if head else salts) if salts else ())
        if chain is not None:  # verification: the router's chain is the one indexed
            mismatched = sum(map(ne, tandem, chain[head:] if head else chain))
            worker.mismatched_blocks += mismatched
    else:
        tandem = chain[head:] if head else chain
        if verify_hashes:
            worker.unverified_blocks += len(tandem)
    if unlinked:
        worker.runs.open()  # blocks under a parent the worker does not hold (as far as the index knows)
    run_parent = parent_hash if head or event.parent_block_hash is not None else None
    return insert_blocks(worker, holders, engine_hashes, tandem, run_parent), 0, 0, unlinked, mismatched


def _new_blocks_start(tandem_of: dict[int, int], event: BlockStored | BlockStoredWithoutTokens,
                      ) -> tuple[int, int | None, bool]:
    """Where the new blocks of a non-empty `event` start (after the head this worker already
    announced; all its blocks when it is all known), the Tandem hash of the first new block's
    parent (None: not known), and whether the event names a parent the index does not know."""
    engine_hashes = event.block_hashes
    if engine_hashes[0] in tandem_of:
        # Blocks announced again (vLLM can re-announce prefix-cache hits): a known engine
        # hash of this worker names the same tokens, so the known head is not re-hashed.
        known = list(map(tandem_of.__contains__, engine_hashes))
        head = known.index(False) if False in known else len(engine_hashes)
        if head == len(engine_hashes):
            return head, None, False
        return head, tandem_of[engine_hashes[head - 1]], False
    if event.parent_block_hash is None:
        return 0, chain_root(event.adapter, event.cache_salt), False
    parent_hash = tandem_of.get(event.parent_block_hash)
    return 0, parent_hash, parent_hash is None


def _packed_or_none(event: BlockStored | BlockStoredWithoutTokens) -> bytes | None:
    """The event's token ids packed; None for ids that are no u32 (sent unpacked by a buggy worker)."""
    try:
        return packed_token_ids_of(event)
    except OverflowError:
        return None


def insert_blocks(worker: IndexedWorker, holders: dict[int, int], engine_hashes: list[int], tandem: list[int],
                  parent: int | None) -> int:
    """Index blocks the worker stored (engine hash -> Tandem hash); returns how many.

    The common cases run in C (dict views, map, zip): blocks no worker holds get the
    worker's own bit object; blocks only other workers hold get their mask or'ed with it.
    Blocks the worker holds already (a prediction, or another engine hash of the same
    tokens) take the loop. `parent`: the worker's block the chain hangs under (None: the root)."""
    tandem_of = worker.tandem_of
    runs = worker.runs
    if not tandem_of.keys().isdisjoint(engine_hashes):  # rare: a known block past the head
        runs.open()  # the run skips blocks it holds already: leaves can no longer be told
        fresh = [(engine_hash, block_hash) for engine_hash, block_hash in zip(engine_hashes, tandem)
                 if engine_hash not in tandem_of]
        engine_hashes = [engine_hash for engine_hash, _ in fresh]
        tandem = [block_hash for _, block_hash in fresh]
    bit = worker.bit
    speculative = worker.speculative
    if speculative and not speculative.keys().isdisjoint(tandem):
        promoted = speculative.keys() & tandem
        for block_hash in promoted:
            del speculative[block_hash]  # a real block supersedes the prediction; its bit stays
            runs.unspeculated(block_hash)
    else:
        promoted = set()
    if holders.keys().isdisjoint(tandem):  # the common case: blocks no worker holds yet
        holders.update(zip(tandem, repeat(bit)))
    else:
        masks = list(map(holders.get, tandem))
        if not promoted and not any(map(and_, filter(None, masks), repeat(bit))):
            holders.update(zip(tandem, [bit if mask is None else mask | bit for mask in masks]))
        else:
            extra_refs = worker.extra_refs
            for block_hash, mask in zip(tandem, masks):
                if mask is None:
                    holders[block_hash] = bit
                elif not mask & bit:
                    holders[block_hash] = mask | bit
                elif block_hash not in promoted:  # another engine hash of this worker, same tokens
                    extra_refs[block_hash] = extra_refs.get(block_hash, 0) + 1
                    runs.open()
    tandem_of.update(zip(engine_hashes, tandem))
    if runs.closed and tandem:  # `Runs.stored`, inline: once per event on the ingest path
        runs.tails[tandem[-1]] = [parent, tandem, len(tandem)]
        if parent is not None:
            runs.kids[parent] = runs.kids.get(parent, 0) + 1
    return len(tandem)
