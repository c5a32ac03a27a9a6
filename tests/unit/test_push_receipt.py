"""The reader's end of a push (`connector.push_receipt.PushReceipt`), the same for both
engines: what landed, what verified, what the engine committed, and the record."""

from __future__ import annotations

from connector.dataplane import Prepared
from connector.push_receipt import PushReceipt
from shared.schemas.transfer import PushDone

BLOCK = 4
TARGETS = [20, 21, 22, 23]
GOOD = [1, 2, 3, 4]  # the reader's checksums of its target blocks (one KV head)


def receipt(failed: list[int], checksums: list[int] = (1, 2, 3, 4)) -> PushReceipt:
    message = PushDone(transfer_id="r1", outcome="failed" if failed else "done", checksums=list(checksums),
                       first_token=7, failed_blocks=failed)
    return PushReceipt("reader", "r1", message, TARGETS, block_size=BLOCK, block_nbytes=100, started=10.0)


def test_every_block_written_and_verified_is_done() -> None:
    push = receipt([])
    assert push.verify(GOOD) == [True] * 4
    push.committed([True] * 4, 12.0)
    record = push.record()
    assert (record.kind, record.outcome, record.blocks, record.blocks_ok, record.bytes) == ("push", "done", 4, 4, 400)
    assert (record.pulled_tokens, record.recomputed_tokens, record.duration_s, record.reason) == (16, 0, 2.0, "")
    prepared = Prepared()
    push.fill(prepared)
    assert (prepared.pulled_tokens, prepared.recomputed_tokens, prepared.recomputed_blocks) == (16, 0, 0)


def test_blocks_not_written_and_blocks_corrupt_are_told_apart_and_computed() -> None:
    push = receipt([1], checksums=[1, 2, 99, 4])  # block 1 not written, block 2 arrived corrupt
    assert push.landed == [True, False, True, True]
    ok = push.verify(GOOD)
    assert ok == [True, False, False, True]
    push.committed(ok, 11.0)  # the sim commits every verified block
    record = push.record()
    assert (record.outcome, record.blocks_ok, record.reason) == ("failed", 2, "1 block(s) not written, 1 did not verify")
    assert (record.pulled_tokens, record.recomputed_tokens) == (8, 8)
    attributes = push.span_attributes()
    assert (attributes["tandem.kv.failed_blocks"], attributes["tandem.kv.corrupt_blocks"]) == ([1], [2])
    assert push.failed_blocks == [1, 2]


def test_an_engine_that_keeps_only_the_leading_verified_blocks_computes_the_rest() -> None:
    push = receipt([2])
    ok = push.verify(GOOD)
    push.committed([index < ok.index(False) for index in range(4)], 11.0)  # vLLM: no holes
    record = push.record()
    assert (record.outcome, record.blocks_ok, record.recomputed_tokens) == ("failed", 2, 8)
    assert record.reason == "1 block(s) not written, 0 did not verify, 1 sound but not kept"
    prepared = Prepared()
    push.fill(prepared)
    assert prepared.recomputed_blocks == 2


def test_a_verified_block_the_engine_did_not_commit_is_failed() -> None:
    push = receipt([])
    push.verify(GOOD)
    push.committed([True, True, True, False], 11.0)
    record = push.record()
    assert (record.outcome, record.blocks_ok) == ("failed", 3)
    assert record.reason == "0 block(s) not written, 0 did not verify, 1 sound but not kept"


def test_a_push_to_no_blocks_is_done_and_empty() -> None:
    message = PushDone(transfer_id="r1", outcome="done", checksums=[], first_token=7, failed_blocks=[])
    push = PushReceipt("reader", "r1", message, [], block_size=BLOCK, block_nbytes=100, started=10.0)
    push.verify([])
    push.committed([], 10.5)
    assert (push.record().outcome, push.record().blocks, push.record().pulled_tokens) == ("done", 0, 0)


def test_every_head_of_a_block_must_match() -> None:
    push = receipt([], checksums=[1, 10, 2, 20, 3, 30, 4, 40])  # two KV heads a block
    assert push.verify([1, 10, 2, 21, 3, 30, 4, 40]) == [True, False, True, True]


def test_a_partial_last_block_counts_its_prompt_tokens() -> None:
    """A vLLM reader targets the prompt's partial last block too (14 tokens: 3 full blocks
    and 2): kept, it brings 2 tokens; lost, 2 are computed."""
    message = PushDone(transfer_id="r1", outcome="done", checksums=list(GOOD), first_token=7, failed_blocks=[])
    push = PushReceipt("reader", "r1", message, TARGETS, block_size=BLOCK, block_nbytes=100, started=10.0,
                       prompt_tokens=14)
    push.verify(GOOD)
    push.committed([True] * 4, 11.0)
    assert (push.record().pulled_tokens, push.record().recomputed_tokens) == (14, 0)
    push.committed([True, True, True, False], 11.0)  # the partial block not kept
    record, prepared = push.record(), Prepared()
    push.fill(prepared)
    assert (record.pulled_tokens, record.recomputed_tokens, record.blocks_ok) == (12, 2, 3)
    assert (prepared.pulled_tokens, prepared.recomputed_tokens, prepared.recomputed_blocks) == (12, 2, 1)
