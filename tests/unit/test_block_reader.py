"""The rules every reader shares (checksum verification, injected faults, the push wait) and the vLLM
data plane's staging of orders, without vLLM, NIXL or NATS."""

from __future__ import annotations

import asyncio

import pytest

from connector.block_reader import pushed_blocks, verified_blocks
from connector.dataplane import Prepared
from connector.faults import blocks_before_cut, chosen, inject_read_faults, write_faults
from connector.push import wait_for_push
from connector.vllm.engine_port import StagedTransfer
from connector.vllm.kv_wire import TransferOrder
from connector.vllm.worker_kv import VllmWorkerKv
from shared.config import KvFaultConfig, WorkerConfig
from shared.errors import Timeout, Unavailable
from shared.schemas import GenerateRequest, KvTransferParams, PushDone, SamplingParams


def test_a_block_is_sound_only_if_it_landed_and_its_checksum_matches() -> None:
    checksums = {10: 111, 11: 222, 12: 333}
    ok = verified_blocks([True, True, False], [10, 11, 12], [111, 999, 333], checksums.__getitem__)
    assert ok == [True, False, False]
    assert verified_blocks([True, True], [10, 11], [111], checksums.__getitem__) == [True, False]  # no checksum


def test_injected_read_faults_scribble_what_did_not_land() -> None:
    scribbled: list[int] = []
    ok = [True, False, True, True]
    injected = inject_read_faults(KvFaultConfig(), [1, 2, 3, 4], [5, 6, 7, 8], ok, scribbled.append)
    assert not injected and ok == [True, False, True, True] and scribbled == [6]
    ok = [True] * 200
    scribbled.clear()
    injected = inject_read_faults(KvFaultConfig(fail_fraction=0.5, seed=1), list(range(200)), list(range(200)),
                                  ok, scribbled.append)
    assert injected and 0 < ok.count(False) < 200 and {i for i, good in enumerate(ok) if not good} <= set(scribbled)
    assert blocks_before_cut(KvFaultConfig(cut_after_blocks=3), 5) == 3
    assert blocks_before_cut(KvFaultConfig(), 5) == 5


def test_one_write_rule_fails_some_blocks_and_silently_skips_others() -> None:
    config = KvFaultConfig(fail_fraction=0.3, corrupt_fraction=0.3, seed=4)
    remote = list(range(100, 160))
    faults = write_faults(config, remote)
    assert faults.failed == [i for i, block in enumerate(remote) if chosen(4, "fail", block, 0.3)]
    corrupt = [i for i, block in enumerate(remote) if i not in faults.failed and chosen(4, "corrupt", block, 0.3)]
    assert faults.failed and corrupt
    assert sorted(faults.written + faults.failed + corrupt) == list(range(len(remote)))
    assert write_faults(KvFaultConfig(), remote).written == list(range(len(remote)))


def test_a_push_landed_where_the_writer_says_so() -> None:
    done = PushDone(transfer_id="t", outcome="failed", checksums=[], failed_blocks=[1])
    assert pushed_blocks(done, 3) == [True, False, True]
    assert pushed_blocks(PushDone(transfer_id="t", outcome="cancelled", checksums=[]), 2) == [False, False]


async def test_the_push_wait_gives_the_blocks_back_unless_a_first_token_came() -> None:
    given_back: list[str] = []
    loop = asyncio.get_running_loop()
    with pytest.raises(Timeout):
        await wait_for_push(loop.create_future(), 0.01, lambda: given_back.append("timeout"))
    failed = loop.create_future()
    failed.set_result(PushDone(transfer_id="t", outcome="failed", checksums=[]))
    with pytest.raises(Unavailable):
        await wait_for_push(failed, 1.0, lambda: given_back.append("failed"))
    done = loop.create_future()
    done.set_result(PushDone(transfer_id="t", outcome="done", checksums=[1], first_token=7))
    assert (await wait_for_push(done, 1.0, lambda: given_back.append("done"))).first_token == 7
    assert given_back == ["timeout", "failed"]


class StagingEngine:
    """The part of `VllmKvEngine` a hold-only request touches."""

    def __init__(self) -> None:
        self.staged: dict[str, StagedTransfer] = {}
        self.unstaged: list[str] = []

    def stage(self, request_id: str, order: TransferOrder, on_loaded=None) -> None:
        self.staged[request_id] = StagedTransfer(order, on_loaded)

    def unstage(self, request_id: str) -> StagedTransfer | None:
        self.unstaged.append(request_id)
        return self.staged.pop(request_id, None)


async def test_an_order_the_engine_never_took_is_taken_back_once() -> None:
    engine = StagingEngine()
    kv = VllmWorkerKv(WorkerConfig(worker_id="w"), None, engine, block_size=16,  # type: ignore[arg-type]
                      compat_hash="c")
    request = GenerateRequest(request_id="r1", model="m", token_ids=list(range(40)),
                              sampling=SamplingParams(max_tokens=1), kv_transfer=KvTransferParams(hold_for_decode=True))
    prepared = await kv.prepare(request)
    assert prepared.staged_request_id == "r1" and engine.staged["r1"].order.hold_key.startswith("r1#")
    kv.release_pins(prepared)
    kv.release_pins(prepared)  # idempotent: the order is taken back once
    assert engine.unstaged == ["r1"] and not engine.staged
    kv.release_pins(Prepared())  # nothing staged: nothing to take back
    assert engine.unstaged == ["r1"]
