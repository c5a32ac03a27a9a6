"""What a pull claims and reads, and what a finished prefill holds (the connector's
scheduler side, on plain requests, no engine): the prompt's partial last block travels too,
so the decode worker computes one token, not the rest of a block."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from vllm.v1.request import RequestStatus  # noqa: E402

from connector.vllm.connector_scheduler import SchedulerSide  # noqa: E402
from connector.vllm.kv_wire import PullOrder, TransferOrder, held_of, order_params  # noqa: E402

BLOCK = 128


class Pool:
    def __init__(self) -> None:
        self.blocks = [SimpleNamespace(block_id=index) for index in range(64)]
        self.num_gpu_blocks = len(self.blocks)
        self.touched: list[int] = []

    def touch(self, blocks) -> None:
        self.touched.extend(block.block_id for block in blocks)


def pulling(num_tokens: int, holder_blocks: int, tail_tokens: int = 0) -> tuple[SchedulerSide, SimpleNamespace]:
    side = SchedulerSide(block_size=BLOCK, reports=None)  # type: ignore[arg-type]
    pull = PullOrder(lease_id="l1", agent_name="holder", agent_metadata=b"m", block_ids=list(range(40, 40 + holder_blocks)),
                     checksums=list(range(holder_blocks)), tail_tokens=tail_tokens)
    request = SimpleNamespace(request_id="r1", kv_transfer_params=order_params(TransferOrder(transfer_id="t1", pull=pull)),
                              num_tokens=num_tokens)
    side.on_new_request(request)  # type: ignore[arg-type]
    return side, request


def allocated(block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (block_ids,))


@pytest.mark.parametrize(("replayed", "num_tokens"), [(False, 901), (True, 900)])
def test_a_held_partial_block_leaves_one_token_to_compute(replayed: bool, num_tokens: int) -> None:
    """A 900-token prompt held as 7 full blocks and 4 tokens: the decode part (the prompt and
    the first token, or the prompt alone when it replays the first token) claims every
    token but its last, and reads all 8 blocks."""
    side, request = pulling(num_tokens, 8, tail_tokens=900 - 7 * BLOCK)
    assert side.matched_tokens(request, 0) == num_tokens - 1  # type: ignore[arg-type]
    side.after_alloc(request, allocated(list(range(8))), num_tokens - 1)  # type: ignore[arg-type]
    [load] = side.take_loads()
    assert (load.remote_block_ids, load.local_block_ids, load.cached_blocks) == (list(range(40, 48)), list(range(8)), 0)


def test_locally_cached_blocks_are_not_read_and_the_partial_block_is() -> None:
    side, request = pulling(901, 8, tail_tokens=4)
    assert side.matched_tokens(request, 3 * BLOCK) == 900 - 3 * BLOCK  # type: ignore[arg-type]
    side.after_alloc(request, allocated(list(range(10, 18))), 900 - 3 * BLOCK)  # type: ignore[arg-type]
    [load] = side.take_loads()
    assert (load.remote_block_ids, load.local_block_ids, load.checksums, load.cached_blocks) == (
        [43, 44, 45, 46, 47], [13, 14, 15, 16, 17], [3, 4, 5, 6, 7], 3)


def test_full_blocks_alone_leave_the_rest_of_the_prompt_to_compute() -> None:
    side, request = pulling(901, 7)  # a prefix pull: full blocks only
    assert side.matched_tokens(request, 0) == 7 * BLOCK  # type: ignore[arg-type]
    side, request = pulling(7 * BLOCK, 7)  # the prompt ends with its last full block: all but one token
    assert side.matched_tokens(request, 0) == 7 * BLOCK - 1  # type: ignore[arg-type]


@pytest.mark.parametrize(("prompt_tokens", "held", "tail_tokens"), [(900, 8, 4), (896, 7, 0), (100, 1, 100)])
def test_a_finished_prefill_holds_its_partial_block_too(prompt_tokens: int, held: int, tail_tokens: int) -> None:
    """After its full blocks, or alone for a prompt shorter than a block."""
    side = SchedulerSide(block_size=BLOCK, reports=None)  # type: ignore[arg-type]
    pool = Pool()
    side.bind_block_pool(pool)  # type: ignore[arg-type]
    request = SimpleNamespace(request_id="r1", num_prompt_tokens=prompt_tokens, status=RequestStatus.FINISHED_LENGTH_CAPPED,
                              kv_transfer_params=order_params(TransferOrder(transfer_id="t1", hold_key="k1")),
                              block_hashes=[])
    side.on_new_request(request)  # type: ignore[arg-type]
    params = side.request_finished(request, list(range(20, 29)))  # type: ignore[arg-type]
    out = held_of(params)
    assert out is not None and (out.block_ids, out.tail_tokens) == (list(range(20, 20 + held)), tail_tokens)
    assert pool.touched == out.block_ids and side.pinned_blocks == held
