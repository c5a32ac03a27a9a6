"""The writer's account of a push (`connector.push_ledger`), the same for both engines:
what is still to send whole, which blocks failed, and the end of the push."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from connector.push_ledger import PushLedger, abort_push, end_push

LAYERS = 3


def test_blocks_computed_here_are_sent_by_layer_and_reused_ones_whole() -> None:
    ledger = PushLedger(4)
    ledger.source([0, 1], [50, 51])  # computed in the first step
    for layer in range(LAYERS):
        ledger.sent([0, 1], layer)
    ledger.source([2, 3], [52, 53])  # reused from the cache: no layer hook named them
    assert ledger.unsent(LAYERS) == [2, 3]
    assert ledger.ok() == [True] * 4 and ledger.failed_blocks() == []
    two_heads = lambda block_ids: [value for block_id in block_ids for value in (block_id + 1000, block_id + 2000)]  # noqa: E731
    assert ledger.checksums(two_heads, 2) == [1050, 2050, 1051, 2051, 1052, 2052, 1053, 2053]


def test_a_layer_sent_twice_does_not_stand_for_a_missing_one() -> None:
    ledger = PushLedger(1)
    ledger.source([0], [50])
    ledger.sent([0], 0)
    ledger.sent([0], 1)
    ledger.sent([0], 1)  # a preempted request computed it again: reported again
    assert ledger.unsent(LAYERS) == [0]


def test_failed_writes_and_blocks_without_a_source_fail() -> None:
    ledger = PushLedger(4)
    ledger.source([0, 1, 2], [50, 51, 52])  # block 3: the engine never had it
    ledger.fail([1])
    assert ledger.ok() == [True, False, True, False]
    assert ledger.failed_blocks() == [1, 3]
    assert ledger.checksums(list, 1) == [50, 51, 52, 0]  # block 3: no source, no checksum
    ledger.fail_all()
    assert ledger.failed_blocks() == [0, 1, 2, 3]


def test_the_end_of_a_push_says_its_outcome_on_the_span_and_to_the_reader() -> None:
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("kv.push")
    done = end_push(span, "r1", 7, [1, 2], [1], writes=4, nbytes=800, reason="injected")
    assert (done.outcome, done.failed_blocks, done.first_token, done.checksums) == ("failed", [1], 7, [1, 2])
    assert span.attributes["tandem.kv.outcome"] == "failed" and span.attributes["tandem.kv.writes"] == 4
    assert not span.is_recording()
    clean = end_push(tracer.start_span("kv.push"), "r2", 7, [1], [], writes=1, nbytes=100)
    assert clean.outcome == "done"
    aborted = tracer.start_span("kv.push")
    abort_push(aborted)
    abort_push(aborted)  # once ended, nothing more
    assert aborted.attributes["tandem.kv.outcome"] == "aborted" and not aborted.is_recording()
