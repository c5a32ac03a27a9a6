"""BlockDlists: a peer's prepared list is released when the peer is forgotten, never under a
transfer that still uses it (then when the last such transfer ends), and all at close."""

from __future__ import annotations

import numpy as np

from connector.agent_types import PoolInfo
from connector.block_dlists import BlockDlists, block_rows


class FakeNixl:
    VRAM_SEG, DRAM_SEG, NIXL_INIT_AGENT = "VRAM", "DRAM", "local"

    @staticmethod
    def nixlXferDList(segment, rows):  # noqa: N802 - the bindings' name
        return (segment, rows)


class FakeBindings:
    """prepXferDlist hands out numbered handles; releasedDlistH records them."""

    def __init__(self) -> None:
        self.prepared: list[tuple[str, str, int]] = []
        self.released: list[int] = []

    def prepXferDlist(self, owner, dlist, backends):  # noqa: N802
        segment, rows = dlist
        self.prepared.append((owner, segment, len(rows)))
        return len(self.prepared)

    def releasedDlistH(self, handle):  # noqa: N802
        self.released.append(handle)


POOL = PoolInfo(base_addr=4096, block_nbytes=256, num_blocks=8, mem_type="VRAM", device_id=1)


def dlists() -> tuple[BlockDlists, FakeBindings]:
    bindings = FakeBindings()
    lists = BlockDlists(bindings, FakeNixl, (RuntimeError,))
    lists.prepare_local(POOL)
    return lists, bindings


def test_one_row_per_block_in_the_pools_memory():
    rows = block_rows(POOL)
    assert rows.shape == (8, 3) and rows.dtype == np.uint64
    assert rows[:, 0].tolist() == [4096 + 256 * block for block in range(8)]
    assert set(rows[:, 1].tolist()) == {256} and set(rows[:, 2].tolist()) == {1}


def test_a_peer_without_a_list_gets_none_and_one_with_gets_both():
    lists, bindings = dlists()
    assert lists.take("decode-0") is None
    lists.prepare_peer("decode-0", POOL)
    assert lists.take("decode-0") == (1, 2)
    assert bindings.prepared == [("local", "VRAM", 8), ("decode-0", "VRAM", 8)]


def test_a_forgotten_peers_list_is_released_after_its_last_transfer():
    lists, bindings = dlists()
    lists.prepare_peer("decode-0", POOL)
    first, second = lists.take("decode-0"), lists.take("decode-0")
    lists.forget_peer("decode-0")
    assert bindings.released == [] and lists.take("decode-0") is None
    lists.give_back(first[1])
    assert bindings.released == []
    lists.give_back(second[1])
    assert bindings.released == [2]


def test_an_idle_list_is_released_at_once_and_a_re_added_peer_gets_a_new_one():
    lists, bindings = dlists()
    lists.prepare_peer("decode-0", POOL)
    taken = lists.take("decode-0")
    lists.give_back(taken[1])
    lists.prepare_peer("decode-0", POOL)  # a restarted peer under the same name
    assert bindings.released == [2] and lists.take("decode-0") == (1, 3)


def test_close_releases_every_list_once():
    lists, bindings = dlists()
    lists.prepare_peer("a", POOL)
    lists.prepare_peer("b", POOL)
    lists.take("b")
    lists.forget_peer("b")  # in use: retired, not released
    lists.close()
    assert sorted(bindings.released) == [1, 2, 3]
    lists.close()
    assert sorted(bindings.released) == [1, 2, 3]
