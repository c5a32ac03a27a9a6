"""The pure parts of Tandem's vLLM connector: page addressing, checksums, the messages
that cross vLLM's process boundaries (no vLLM needed)."""

from __future__ import annotations

import msgspec
import pytest

from connector.descriptors import coalesce_block_runs
from connector.vllm.kv_pages import PageGeometry, page_ids
from connector.vllm.kv_wire import (
    Held,
    Loaded,
    Pinned,
    PinOrder,
    PullOrder,
    Pushed,
    TransferOrder,
    UnpinOrder,
    control_of,
    control_params,
    decode_report,
    encode_report,
    held_of,
    held_params,
    merge_loaded,
    merge_pushed,
    order_of,
    order_params,
)

GEOMETRY = PageGeometry(num_layers=3, num_blocks=10, page_nbytes=16)


def test_page_ids_are_layer_major_and_keep_pairs_aligned() -> None:
    assert page_ids([4, 5], 3, 10).tolist() == [4, 5, 14, 15, 24, 25]
    assert page_ids([], 3, 10).tolist() == []
    # Adjacent blocks stay adjacent within each layer: one descriptor per layer per run.
    runs = coalesce_block_runs(page_ids([4, 5, 6], 3, 10), page_ids([7, 8, 9], 3, 12))
    assert len(runs) == 3 and runs.counts.tolist() == [3, 3, 3]
    assert runs.remote_starts.tolist() == [7, 19, 31]  # the peer's own block count addresses its pages


def test_geometry_validation() -> None:
    assert GEOMETRY.nbytes == 3 * 10 * 16
    with pytest.raises(ValueError):
        PageGeometry(num_layers=0, num_blocks=1, page_nbytes=1).validate()


def test_orders_travel_as_plain_kv_transfer_params() -> None:
    order = TransferOrder(transfer_id="r1", hold_key="r1#1", pull=PullOrder(
        lease_id="p-1", agent_name="p-abc", agent_metadata=b"\x00\xffmeta", block_ids=[3, 4], checksums=[7, 8]))
    params = order_params(order)
    assert isinstance(params["tandem"], dict)  # vLLM's kv_transfer_params is a plain dict
    assert order_of(params) == order
    assert order_of(None) is None and order_of({"other": 1}) is None
    assert control_of(control_params(PinOrder(key="k"))) == PinOrder(key="k")
    assert control_of(control_params(UnpinOrder(keys=["a", "b"]))) == UnpinOrder(keys=["a", "b"])
    assert control_of(params) is None  # a generate request's order is not a control order
    assert held_of(held_params(Held(key="k", block_ids=[1, 2]))) == Held(key="k", block_ids=[1, 2])


def test_reports_round_trip_and_loaded_counts_vllms_prefix() -> None:
    loaded = Loaded(transfer_id="r1", lease_id="p-1", cached_blocks=1, ok=[True, False, True], nbytes=5)
    for report in (loaded, Pinned(key="k", block_ids=[1])):
        assert decode_report(encode_report(report)) == report
    assert loaded.used_blocks == 1  # vLLM keeps the blocks before the first failure
    assert msgspec.structs.replace(loaded, kept=0).used_blocks == 0  # one of its own failed before
    assert Loaded(transfer_id="r", lease_id="l", cached_blocks=0, ok=[True, True]).used_blocks == 2
    assert Loaded(transfer_id="r", lease_id="l", cached_blocks=0, ok=[]).used_blocks == 0


def test_the_ranks_reports_merge_into_the_engines() -> None:
    one = Loaded(transfer_id="r", lease_id="l", cached_blocks=1, ok=[True, True, True], nbytes=5, kept=3)
    two = msgspec.structs.replace(one, ok=[True, False, True], nbytes=7, kept=1, rank=1, reason="checksum mismatch")
    merged = merge_loaded([one, two])
    assert (merged.ok, merged.nbytes, merged.used_blocks, merged.reason) == ([True, False, True], 12, 1,
                                                                             "checksum mismatch")
    first = Pushed(transfer_id="t", ok=[True, True], checksums=[1, 2, 3, 4], heads=[0, 1])
    second = Pushed(transfer_id="t", ok=[True, False], checksums=[5, 6], heads=[2], rank=1)
    pushed = merge_pushed([first, second], 3)
    assert (pushed.ok, pushed.checksums) == ([True, False], [1, 2, 5, 3, 4, 6])
