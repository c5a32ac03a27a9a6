"""A holder pins a prefix by the blocks it announced (the connector's scheduler side, on
plain requests and a fake block pool, no engine): vLLM's hashes of a block with an image in
it take in the image, so the control request's own hashes (tokens alone) miss it; the
short hashes its KV events gave are turned back into vLLM's full ones, learnt from the
requests the side saw, and pin exactly those blocks. Where the announced hashes are unknown
or absent, the control request's prompt is pinned as before."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from connector.vllm.connector_scheduler import SchedulerSide  # noqa: E402
from connector.vllm.engine_hashes import EngineBlockHashes, short_hash  # noqa: E402
from connector.vllm.kv_wire import Pinned, PinOrder, control_params  # noqa: E402

BLOCK = 128


def full_hash(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


WITH_IMAGE = [full_hash(f"block {index} with image-7") for index in range(3)]  # what vLLM cached
TOKENS_ONLY = [full_hash(f"block {index}") for index in range(3)]  # the control request's own


class Pool:
    def __init__(self, cached: dict[bytes, int]) -> None:
        self.blocks = [SimpleNamespace(block_id=index) for index in range(64)]
        self.num_gpu_blocks = len(self.blocks)
        self.cached = cached
        self.touched: list[int] = []

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]):
        block_id = self.cached.get(block_hash)
        return None if block_id is None else [self.blocks[block_id]]

    def touch(self, blocks) -> None:
        self.touched.extend(block.block_id for block in blocks)


class Reports:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, report) -> None:
        self.sent.append(report)


def side_that_served(pool: Pool, block_hashes: list[bytes]) -> tuple[SchedulerSide, Reports]:
    reports = Reports()
    side = SchedulerSide(block_size=BLOCK, reports=reports)  # type: ignore[arg-type]
    side.bind_block_pool(pool)  # type: ignore[arg-type]
    side.on_new_request(SimpleNamespace(request_id="r1", kv_transfer_params=None,  # type: ignore[arg-type]
                                        block_hashes=block_hashes))
    return side, reports


def pin(side: SchedulerSide, reports: Reports, short_hashes: list[int]) -> list[int]:
    side.on_new_request(SimpleNamespace(  # type: ignore[arg-type]
        request_id="control-1", block_hashes=TOKENS_ONLY,
        kv_transfer_params=control_params(PinOrder(key="k1", block_hashes=short_hashes))))
    [pinned] = reports.sent
    assert isinstance(pinned, Pinned) and pinned.key == "k1"
    return pinned.block_ids


def test_the_announced_blocks_of_an_image_prompt_are_pinned_though_its_tokens_alone_hash_otherwise() -> None:
    pool = Pool({block_hash: 10 + index for index, block_hash in enumerate(WITH_IMAGE)})
    side, reports = side_that_served(pool, WITH_IMAGE)
    assert pin(side, reports, [short_hash(block_hash) for block_hash in WITH_IMAGE]) == [10, 11, 12]
    assert pool.touched == [10, 11, 12] and side.pinned_blocks == 3


def test_the_run_stops_at_the_first_block_no_longer_cached() -> None:
    pool = Pool({WITH_IMAGE[0]: 10, WITH_IMAGE[2]: 12})
    side, reports = side_that_served(pool, WITH_IMAGE)
    assert pin(side, reports, [short_hash(block_hash) for block_hash in WITH_IMAGE]) == [10]


def test_without_announced_hashes_the_control_requests_prompt_is_pinned() -> None:
    pool = Pool({block_hash: 20 + index for index, block_hash in enumerate(TOKENS_ONLY)})
    side, reports = side_that_served(pool, TOKENS_ONLY)
    assert pin(side, reports, []) == [20, 21, 22]


def test_hashes_the_side_never_saw_pin_by_the_prompt() -> None:
    pool = Pool({TOKENS_ONLY[0]: 30})
    side, reports = side_that_served(pool, [])
    assert pin(side, reports, [short_hash(block_hash) for block_hash in WITH_IMAGE]) == [30]


def test_the_map_is_bounded_and_forgets_the_oldest_first() -> None:
    hashes = EngineBlockHashes(limit=8)
    blocks = [full_hash(f"b{index}") for index in range(12)]
    hashes.learn(blocks[:8])
    hashes.learn(blocks[:1])  # used again: now the newest
    hashes.learn(blocks[8:])
    assert len(hashes) <= 8
    assert hashes.leading([short_hash(blocks[0]), short_hash(blocks[11])]) == [blocks[0], blocks[11]]
    assert hashes.leading([short_hash(blocks[1])]) == []  # the oldest went first
