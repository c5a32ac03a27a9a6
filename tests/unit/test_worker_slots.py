"""Worker slots (`shared.worker_slots`) on real files and locks: claims in one process and in
two get different slots, a released or dead holder's slot is taken again, an explicit id
claims exactly that slot, and a refusal says what is there and what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.worker_slots import SlotClaim, SlotRefused, claim_slot, listed_slots, make_slots, slot_ids

HOLD_A_SLOT = """
import sys
from shared.worker_slots import claim_slot
claim = claim_slot(sys.argv[1])
print(getattr(claim, "worker_id", "refused"), flush=True)
sys.stdin.read()  # hold it until told to go
"""


def claimed(result: SlotClaim | SlotRefused) -> SlotClaim:
    assert isinstance(result, SlotClaim), result
    return result


def test_slot_ids_sort_in_claiming_order() -> None:
    assert slot_ids(3) == ("w01", "w02", "w03")
    assert slot_ids(120)[-1] == "w120" and slot_ids(120)[0] == "w001"


def test_make_slots_keeps_existing_files_and_removes_those_past_the_count(tmp_path: Path) -> None:
    assert make_slots(tmp_path, 3) == ("w01", "w02", "w03")
    assert listed_slots(tmp_path) == ("w01", "w02", "w03")
    with claimed(claim_slot(tmp_path, "w03")):
        assert make_slots(tmp_path, 2) == ("w01", "w02")  # w03's holder keeps its lock, nobody else gets it
        assert listed_slots(tmp_path) == ("w01", "w02")
    with pytest.raises(ValueError):
        make_slots(tmp_path, 0)


def test_two_claims_in_one_process_get_different_slots_and_a_released_one_is_taken_again(tmp_path: Path) -> None:
    make_slots(tmp_path, 2)
    first, second = claimed(claim_slot(tmp_path)), claimed(claim_slot(tmp_path))
    assert (first.worker_id, second.worker_id) == ("w01", "w02")
    refused = claim_slot(tmp_path)
    assert isinstance(refused, SlotRefused)
    assert refused.reason.startswith(f"all 2 worker slots in {tmp_path} (w01..w02) are held by other workers")
    assert "TANDEM_WORKER_SLOTS" in refused.reason and "\n" not in refused.reason
    first.release()
    first.release()  # twice is harmless
    again = claimed(claim_slot(tmp_path))
    assert again.worker_id == "w01"
    again.release()
    second.release()


def test_a_slot_held_by_another_process_is_skipped_until_that_process_dies(tmp_path: Path) -> None:
    make_slots(tmp_path, 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_A_SLOT, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "w01"
        with claimed(claim_slot(tmp_path)) as mine:
            assert mine.worker_id == "w02"
        assert isinstance(claim_slot(tmp_path, "w01"), SlotRefused)
    finally:
        holder.kill()  # no clean exit: the kernel drops the lock with the process
        holder.wait(timeout=10)
    with claimed(claim_slot(tmp_path)) as taken_over:
        assert taken_over.worker_id == "w01"


def test_an_explicit_id_claims_exactly_that_slot(tmp_path: Path) -> None:
    make_slots(tmp_path, 3)
    with claimed(claim_slot(tmp_path, "w02")) as chosen:
        assert chosen.worker_id == "w02"
        held = claim_slot(tmp_path, "w02")
        assert held == SlotRefused(f"worker slot w02 in {tmp_path} is held by another worker")
        with claimed(claim_slot(tmp_path)) as first_free:
            assert first_free.worker_id == "w01"
    unknown = claim_slot(tmp_path, "decode-1")
    assert unknown == SlotRefused(f"no worker slot 'decode-1' in {tmp_path} (slots: w01..w03)")


def test_no_slots_made_is_a_refusal_that_says_where_they_come_from(tmp_path: Path) -> None:
    refused = claim_slot(tmp_path / "absent")
    assert isinstance(refused, SlotRefused) and "no worker slots in" in refused.reason
    (tmp_path / "w01.lock.tmp").touch()
    assert listed_slots(tmp_path) == ()
