"""The pull state machine (`connector.pull.Pull`) both engines' data planes drive: every
way a pull ends, what its lease is released with, what is used and what is computed."""

from __future__ import annotations

import msgspec
import pytest

from connector.block_io import VerifiedRead
from connector.dataplane import Prepared
from connector.pull import EXPIRED_UNUSED, EXPIRED_USED, Pull
from shared.schemas.transfer import KvHandle, KvTail

BLOCK = 4


def handle(blocks: int = 4, tail_tokens: int = 0) -> KvHandle:
    return KvHandle(holder_worker_id="holder", agent_name="agent", lease_id="holder-1", compat_hash="c",
                    block_size=BLOCK, block_ids=[10 + index for index in range(blocks)],
                    block_hashes=[100 + index for index in range(blocks)],
                    checksums=[1000 + index for index in range(blocks)], ttl_s=10.0,
                    tail=KvTail(block_id=99, checksums=[999], tokens=tail_tokens) if tail_tokens else None)


def begin(prompt_tokens: int = 20, *, kv: KvHandle | None = None, takes_tail: bool = False) -> Pull:
    return Pull.begin("reader", "r1", kv or handle(), "pull", prompt_tokens, takes_tail=takes_tail, started=100.0)


def read(ok: list[bool], *, landed: list[bool] | None = None, reason: str = "", retried: int = 0,
         recovered: int = 0) -> VerifiedRead:
    return VerifiedRead(landed=landed or list(ok), first_ok=list(ok), ok=list(ok), nbytes=64 * sum(ok), reason=reason,
                        retried=retried, recovered=recovered)


def sim_order(pull: Pull, result: VerifiedRead, held: bool | None, commits: bool = True) -> None:
    """The sim's order: read, release, then commit what is usable."""
    pull.landed(result, 101.0)
    pull.released(held)
    pull.committed([ok and commits for ok in pull.usable()])


def test_every_block_sound_is_done_and_pulled() -> None:
    pull = begin()
    assert (pull.wanted, pull.remote_block_ids, pull.checksums) == (4, [10, 11, 12, 13], [1000, 1001, 1002, 1003])
    sim_order(pull, read([True] * 4, retried=1, recovered=1), True)
    assert pull.release() == ("done", [])
    record = pull.record()
    assert (record.outcome, record.blocks, record.blocks_ok, record.bytes, record.reason) == ("done", 4, 4, 256, "")
    assert (record.pulled_tokens, record.recomputed_tokens, record.duration_s) == (16, 0, 1.0)
    assert (record.blocks_retried, record.blocks_recovered) == (1, 1)
    prepared = Prepared()
    pull.fill(prepared)
    assert (prepared.pulled_tokens, prepared.recomputed_tokens, prepared.recomputed_blocks) == (16, 0, 0)
    assert (prepared.retried_blocks, prepared.recovered_blocks) == (1, 1)


def test_failed_blocks_are_released_as_failed_and_computed() -> None:
    pull = begin()
    pull.skip(1)  # block 0 is cached here: not read
    assert pull.remote_block_ids == [11, 12, 13]
    sim_order(pull, read([True, False, True], landed=[True, True, True], reason="checksum mismatch"), True)
    assert pull.release() == ("failed", [2])
    assert pull.failed_blocks == [2]
    record = pull.record()
    assert (record.outcome, record.blocks, record.blocks_ok, record.reason) == ("failed", 3, 2, "checksum mismatch")
    assert (record.pulled_tokens, record.recomputed_tokens) == (8, 4)
    attributes = pull.span_attributes()
    assert (attributes["tandem.kv.blocks_failed"], attributes["tandem.kv.blocks_corrupt"]) == (0, 1)
    assert attributes["tandem.kv.corrupt_blocks"] == [2]


def test_a_block_refused_at_commit_is_failed_and_named() -> None:
    pull = begin()
    pull.landed(read([True] * 4), 101.0)
    pull.released(True)
    assert pull.release() == ("done", [])  # the holder's blocks were sound
    pull.committed([True, True, False, True])  # the engine's own check refused one
    record = pull.record()
    assert (record.outcome, record.blocks_ok, record.reason) == ("failed", 3, "1 block(s) failed verification")


def test_a_lease_expired_before_the_commit_leaves_every_block_unused() -> None:
    pull = begin()
    sim_order(pull, read([True] * 4), False)
    assert pull.usable() == [False] * 4
    record = pull.record()
    assert (record.outcome, record.blocks_ok, record.reason) == ("expired", 0, EXPIRED_UNUSED)
    assert (record.pulled_tokens, record.recomputed_tokens) == (0, 16)


def test_a_lease_expired_after_the_engine_committed_keeps_the_verified_blocks() -> None:
    """vLLM's order: the engine reads and commits, the lease is released afterwards."""
    pull = begin()
    pull.landed(read([True, True, False, True], reason="read failed"), 101.0)
    pull.committed([True, True, False, False])  # no holes: computed from the first failure on
    pull.released(False)
    record = pull.record()
    assert (record.outcome, record.blocks_ok, record.reason) == ("expired", 2, "read failed")
    assert (record.pulled_tokens, record.recomputed_tokens) == (8, 8)
    clean = begin()
    clean.landed(read([True] * 4), 101.0)
    clean.committed([True] * 4)
    clean.released(False)
    assert (clean.record().outcome, clean.record().reason, clean.blocks_ok) == ("expired", EXPIRED_USED, 4)


def test_no_answer_to_the_release_keeps_the_blocks() -> None:
    pull = begin()
    sim_order(pull, read([True] * 4), None)
    assert (pull.record().outcome, pull.blocks_ok) == ("done", 4)


def test_a_pull_cancelled_mid_read_releases_as_cancelled_and_computes_nothing() -> None:
    pull = begin()
    pull.cancelled(101.0)
    assert pull.release() == ("cancelled", [])
    pull.released(False)  # an expiry changes nothing: nothing was read
    record = pull.record()
    assert (record.outcome, record.blocks, record.blocks_ok, record.reason) == ("cancelled", 4, 0, "cancelled")
    assert (record.pulled_tokens, record.recomputed_tokens, pull.blocks_recomputed) == (0, 0, 0)


def test_an_unreachable_holder_fails_every_block() -> None:
    pull = begin()
    pull.skip(1)
    pull.nothing_arrived(101.0, "holder unreachable")
    assert pull.release() == ("failed", [1, 2, 3])
    pull.released(True)
    pull.committed(pull.usable())
    record = pull.record()
    assert (record.outcome, record.blocks, record.blocks_ok, record.reason) == ("failed", 3, 0, "holder unreachable")
    assert (record.bytes, record.pulled_tokens, record.recomputed_tokens) == (0, 0, 12)
    assert pull.span_attributes()["tandem.kv.failed_blocks"] == [1, 2, 3]


def test_no_free_blocks_cancels_and_computes_them_all() -> None:
    pull = begin()
    pull.no_free_blocks(101.0)
    assert pull.release() == ("cancelled", [])
    pull.released(False)
    record = pull.record()
    assert (record.outcome, record.blocks, record.blocks_ok, record.reason) == ("cancelled", 4, 0, "no free blocks")
    assert (record.recomputed_tokens, pull.blocks_recomputed) == (16, 4)


def test_every_block_cached_here_is_done_without_a_read() -> None:
    pull = begin()
    pull.skip(4)
    assert pull.blocks == 0
    pull.nothing_to_read(101.0)
    assert pull.release() == ("done", [])
    pull.released(False)
    record = pull.record()
    assert (record.outcome, record.blocks, record.reason, record.pulled_tokens) == ("done", 0, "already cached", 0)
    short = begin(3)  # not one full block of the prompt
    short.nothing_to_read(101.0)
    assert (short.wanted, short.record().reason) == (0, "no full block of the prompt")


def test_the_prompt_bounds_the_wanted_blocks_and_a_tail_counts_its_tokens() -> None:
    assert begin(9).wanted == 2
    with_tail = handle(2, tail_tokens=3)
    assert begin(12, kv=with_tail).wanted == 2  # the sim takes no tail
    pull = begin(12, kv=with_tail, takes_tail=True)  # 8 tokens of full blocks, 3 of the tail, 1 computed
    assert (pull.wanted, pull.tail_tokens, pull.remote_block_ids, pull.checksums) == (3, 3, [10, 11, 99],
                                                                                       [1000, 1001, 999])
    assert begin(11, kv=with_tail, takes_tail=True).tail_tokens == 3
    assert begin(10, kv=with_tail, takes_tail=True).tail_tokens == 0  # the prompt ends inside the tail
    pull.landed(read([True, True, False]), 101.0)
    pull.committed([True, True, False])
    assert (pull.pulled_tokens, pull.recomputed_tokens) == (8, 3)


def test_a_prompt_shorter_than_a_block_pulls_its_tail_alone() -> None:
    tail_only = handle(0, tail_tokens=3)  # vLLM's hold of a 3-token prompt: no full block
    pull = begin(4, kv=tail_only, takes_tail=True)  # the decode prompt: the 3 tokens and the first output
    assert (pull.wanted, pull.heads, pull.remote_block_ids, pull.checksums) == (1, 1, [99], [999])
    pull.landed(read([True]), 101.0)
    pull.committed([True])
    assert (pull.pulled_tokens, pull.recomputed_tokens, pull.record().outcome) == (3, 0, "done")
    assert begin(4, kv=tail_only).wanted == 0  # the sim takes no tail: nothing to read


def test_the_engine_may_read_fewer_blocks_than_wanted() -> None:
    pull = begin()
    pull.skip(1)
    pull.landed(read([True, True]), 101.0)  # vLLM loaded only what the prompt still needed
    pull.committed([True, True])
    record = pull.record()
    assert (record.blocks, record.blocks_ok, record.outcome) == (2, 2, "done")


def test_a_pull_ends_once() -> None:
    pull = begin()
    pull.cancelled(101.0)
    with pytest.raises(AssertionError, match="ends once"):
        pull.landed(read([True] * 4), 102.0)


def test_a_reader_of_another_block_size_narrows_the_pull_to_whole_blocks_of_its_own() -> None:
    two_heads = msgspec.structs.replace(handle(4), checksums=list(range(2000, 2008)))
    pull = begin(20, kv=two_heads)
    assert pull.heads == 2 and pull.checksums == list(range(2000, 2008))
    pull.narrow(1, 2)  # a reader of 8-token blocks with one cached: holder blocks 1 and 2
    assert (pull.wanted, pull.blocks, pull.remote_block_ids, pull.checksums) == (3, 2, [11, 12], [2002, 2003, 2004,
                                                                                                  2005])
    pull.landed(read([True, True]), 101.0)
    pull.committed([True, True])
    assert (pull.pulled_tokens, pull.recomputed_tokens, pull.record().blocks) == (2 * BLOCK, 0, 2)
