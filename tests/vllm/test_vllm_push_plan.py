"""What each step of a pushing request writes (the connector's scheduler side, on plain
scheduler outputs), and how the per-layer timings read (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from connector.vllm.connector_scheduler import SchedulerSide  # noqa: E402
from connector.vllm.kv_wire import LayerWritten, PushOrder, TransferOrder, order_params  # noqa: E402
from connector.vllm.push import overlapped_layers  # noqa: E402

BLOCK = 128


class NoReports:
    def send(self, report) -> None:
        raise AssertionError(f"unexpected report {report!r}")


def pushing(prompt_tokens: int, targets: int) -> tuple[SchedulerSide, SimpleNamespace]:
    side = SchedulerSide(block_size=BLOCK, reports=NoReports())  # type: ignore[arg-type]
    order = TransferOrder(transfer_id="t1", push=PushOrder(agent_name="reader", agent_metadata=b"m",
                                                           block_ids=list(range(100, 100 + targets))))
    request = SimpleNamespace(request_id="r1", kv_transfer_params=order_params(order),
                              num_prompt_tokens=prompt_tokens)
    side.on_new_request(request)  # type: ignore[arg-type]
    return side, request


def new_step(computed: int, scheduled: int, block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens={"r1": scheduled},
        scheduled_new_reqs=[SimpleNamespace(req_id="r1", block_ids=(block_ids,), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                              num_computed_tokens=[]))


def cached_step(computed: int, scheduled: int, new_block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens={"r1": scheduled}, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["r1"], resumed_req_ids=set(),
                                              new_block_ids=[(new_block_ids,)], num_computed_tokens=[computed]))


def test_each_chunk_writes_the_blocks_it_completes_and_the_last_asks_for_the_outcome() -> None:
    side, _ = pushing(700, 5)
    [first] = side.take_pushes(new_step(0, 512, [10, 11, 12, 13]))  # type: ignore[arg-type]
    assert (first.indices, first.local_block_ids, first.final) == ([0, 1, 2, 3], [10, 11, 12, 13], False)
    assert first.target_block_ids == [100, 101, 102, 103, 104] and first.agent_name == "reader"
    [last] = side.take_pushes(cached_step(512, 188, [14, 15]))  # type: ignore[arg-type]
    assert (last.indices, last.local_block_ids, last.final, last.whole_indices) == ([4], [14], True, [])
    assert side.take_pushes(cached_step(700, 1, [])) == []  # decoding: nothing more to push


def test_a_chunk_ending_inside_a_block_writes_it_with_the_next_chunk() -> None:
    side, _ = pushing(400, 3)
    [first] = side.take_pushes(new_step(0, 200, [7, 8]))  # type: ignore[arg-type]
    assert (first.indices, first.final) == ([0], False)
    [last] = side.take_pushes(cached_step(200, 200, [9, 6]))  # type: ignore[arg-type]
    assert (last.indices, last.local_block_ids, last.final) == ([1, 2], [8, 9], True)


def test_blocks_reused_from_the_prefix_cache_are_written_whole_at_the_end() -> None:
    side, _ = pushing(600, 4)
    [only] = side.take_pushes(new_step(256, 344, [20, 21, 22, 23, 24]))  # type: ignore[arg-type]
    assert (only.indices, only.local_block_ids) == ([2, 3], [22, 23])
    assert (only.whole_indices, only.whole_local_block_ids, only.final) == ([0, 1], [20, 21], True)


def test_fewer_targets_than_blocks_and_a_prompt_without_a_full_block() -> None:
    side, _ = pushing(600, 2)  # the reader could spare only two blocks
    [only] = side.take_pushes(new_step(0, 600, [1, 2, 3, 4, 5]))  # type: ignore[arg-type]
    assert (only.indices, only.final) == ([0, 1], True)
    side, _ = pushing(60, 0)
    [only] = side.take_pushes(new_step(0, 60, [1]))  # type: ignore[arg-type]
    assert (only.indices, only.whole_indices, only.final) == ([], [], True)  # still one outcome


def test_overlap_means_a_write_started_before_the_next_layer_was_computed() -> None:
    def write(layer: int, computed: float, started: float) -> LayerWritten:
        return LayerWritten(layer=layer, blocks=4, computed_s=computed, started_s=started, done_s=started + 0.001,
                            ok=True)

    writes = [write(0, 0.010, 0.011), write(1, 0.030, 0.031), write(2, 0.050, 0.060),  # layer 1 overlapped 2
              write(0, 0.100, 0.120), write(1, 0.110, 0.112)]  # a second chunk: layer 0's write began late
    assert overlapped_layers(writes) == [0, 1]
    assert overlapped_layers([write(-1, 0.0, 0.001)]) == []  # whole blocks are not layers
