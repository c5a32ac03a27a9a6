"""KV hand-off between two real vLLM (CPU) workers through Tandem's own connector: real
engines, real NIXL agents in vLLM's model-worker processes, real NATS.

Two engines per test class (start-up ~20 s and ~2.5 GB each; at most two at once on the
development box), pinned to different cores: `TestPullPath` over a clean transport,
`TestFaults` with faults injected in the readers. The prefill worker also serves as the
single-engine reference: greedy output is deterministic across instances, and each
prompt is new to the decode worker, so every disaggregated request really pulls.
Every test leaves no lease, no pinned block and no in-flight request behind.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv "
                                   "(install services/worker/vllm/requirements-cpu.txt)")
psutil = pytest.importorskip("psutil")

from connector.faults import chosen  # noqa: E402
from connector.nixl_agent import nixl_available  # noqa: E402
from connector.sim.transport_builder import build_rank_transports  # noqa: E402
from connector.sim.worker_kv import WorkerKv  # noqa: E402
from connector.vllm.worker_kv import VllmWorkerKv  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from services.worker.sim.config import SimEngineConfig  # noqa: E402
from services.worker.sim.engine import SimEngine  # noqa: E402
from services.worker.vllm.config import VllmEngineConfig  # noqa: E402
from services.worker.vllm.engine import VllmEngine  # noqa: E402
from services.worker.vllm.options import VllmEngineOptions  # noqa: E402
from shared.block_hash import block_hash_chain  # noqa: E402
from shared.bus import Bus, connect  # noqa: E402
from shared.codec import Codec, encode  # noqa: E402
from shared.config import BusConfig, KvFaultConfig, KvTransferConfig, MembershipConfig, WorkerConfig  # noqa: E402
from shared.errors import InvalidArgument  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import Finished, GenerateRequest, KvTransferParams, SamplingParams, TransferRecord  # noqa: E402
from shared.schemas.transfer import KvHandle, LeaseRefused, LeaseReply, LeaseRequest  # noqa: E402
from tests.waiting import wait_for  # noqa: E402
from tests.worker_answers import whole_answer  # noqa: E402

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed in this venv")

BLOCK = 128
MAX_TOKENS = 12


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(length)]  # ids 0-2 are <unk>, <s>, </s>


def worker_config(worker_id: str, bus_config: BusConfig, model_dir: str,
                  transfer: KvTransferConfig) -> WorkerConfig:
    return WorkerConfig(worker_id=worker_id, engine="vllm", model_dir=model_dir, bus=bus_config,
                        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=512, load_interval_s=0.05,
                        kv_event_interval_s=0.01, membership=MembershipConfig(heartbeat_interval_s=0.2, ttl_s=2.0),
                        kv_transfer=transfer)


@dataclass(eq=False)
class VllmWorker:
    config: WorkerConfig
    engine: VllmEngine
    kv: VllmWorkerKv
    service: WorkerService

    def clean(self) -> bool:
        load = self.engine.load()
        return (self.kv.active_leases == 0 and load.kv_used_blocks == 0 and load.running == 0
                and self.service.inflight == 0 and not self.engine._held and not self.engine._staged)


def vllm_processes() -> list[psutil.Process]:
    """vLLM's EngineCore and model-worker processes under this one (named by setproctitle)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith("VLLM") and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def cpu_quiet(processes: list[psutil.Process], window_s: float = 0.5,
              budget_s: float = 0.05) -> Callable[[], bool]:
    """A condition: over the last `window_s` (or more) the processes used less than
    `budget_s` of CPU each on average. After a request the engines finish their last steps and stat
    updates; this is the sign that they have, before idle CPU is measured."""
    mark: dict[str, object] = {}

    def used() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in processes))

    def quiet() -> bool:
        now, total = time.monotonic(), used()
        if not mark:
            mark.update(at=now, total=total)
            return False
        if now - mark["at"] < window_s:  # type: ignore[operator]
            return False
        calm = total - mark["total"] < budget_s * len(processes)  # type: ignore[operator]
        mark.update(at=now, total=total)
        return calm

    return quiet


async def start_vllm_worker(config: WorkerConfig, core: int, bus: Bus) -> VllmWorker:
    """A worker of `config` whose vLLM runs on `core`, with a small KV cache."""
    vllm_config = VllmEngineConfig(kv_cache_gib=0.25, cpu_threads_bind=str(core))
    engine = VllmEngine(VllmEngineOptions.from_worker_config(config, vllm_config))
    await engine.start()
    try:
        kv = VllmWorkerKv(config, bus, engine, block_size=engine.info.block_size,
                          compat_hash=engine.info.compat_hash)
        service = WorkerService(config, engine, bus, kv)
        await service.start()
    except BaseException:
        await engine.stop()
        raise
    return VllmWorker(config, engine, kv, service)


@dataclass(eq=False)
class Pair:
    """A prefill and a decode worker on one bus, and the transfer records they publish."""

    bus: Bus
    bus_config: BusConfig
    prefill: VllmWorker
    decode: VllmWorker
    records: list[TransferRecord] = field(default_factory=list)
    subscription: Any = None

    async def generate(self, worker: VllmWorker, prompt: list[int], max_tokens: int,
                       kv: KvTransferParams | None = None) -> tuple[list[int], Finished]:
        request = GenerateRequest(request_id=f"r-{uuid.uuid4().hex[:8]}", model="tiny", token_ids=prompt,
                                  sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                  kv_transfer=kv)
        return await whole_answer(self.bus, self.bus_config.subjects.generate(worker.config.worker_id), request)

    async def disaggregated(self, prompt: list[int], max_tokens: int) -> tuple[list[int], Finished, Finished]:
        """The router's prefill-first flow: P computes the prompt and holds its blocks, D pulls them."""
        first, p_done = await self.generate(self.prefill, prompt, 1, KvTransferParams(hold_for_decode=True))
        kv = KvTransferParams(source=p_done.kv_handle) if p_done.kv_handle is not None else None
        rest, d_done = await self.generate(self.decode, prompt + first, max_tokens - 1, kv)
        return first + rest, p_done, d_done

    async def against_alone(self, prompt: list[int]) -> tuple[Finished, Finished, int]:
        """`prompt` answered by the prefill worker alone, then disaggregated: the answers must be
        equal. The prefill and the decode part's ends, and the decode engine's count of computed
        prompt tokens before the request (for `decode_computed`)."""
        expected, _ = await self.generate(self.prefill, prompt, MAX_TOKENS)
        computed_before = self.decode.engine.stats.computed_prompt_tokens_total
        got, p_done, d_done = await self.disaggregated(prompt, MAX_TOKENS)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        return p_done, d_done, computed_before

    async def decode_computed(self, before: int, tokens: int, what: str) -> None:
        """Waits for vLLM's own count of the decode engine's computed prompt tokens to be
        `tokens` past `before`."""
        await wait_for(lambda: self.decode.engine.stats.computed_prompt_tokens_total - before == tokens, 5, what)

    async def assert_clean(self) -> None:
        await wait_for(lambda: self.prefill.clean() and self.decode.clean(), 20, "no leases, pins or requests left")

    async def records_since(self, seen: int, count: int = 1) -> list[TransferRecord]:
        """The transfer records after the first `seen`, once `count` are in: a vLLM worker
        publishes a pull's record when the holder answered its release, which may be after
        the request ended."""
        await wait_for(lambda: len(self.records) >= seen + count, 5, f"{count} transfer record(s)")
        return self.records[seen:]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: str) -> str:
    return tiny_model_dir


@pytest.fixture(scope="module")
async def module_bus(nats_server: EmbeddedNats) -> AsyncIterator[tuple[Bus, BusConfig]]:
    bus_config = BusConfig(nats_url=nats_server.url, namespace="t" + uuid.uuid4().hex[:12])
    bus = await connect(bus_config.nats_url, "vllm-kv-test")
    yield bus, bus_config
    await bus.close()


async def start_pair(module_bus: tuple[Bus, BusConfig], model_dir: str, *,
                     prefill_transfer: KvTransferConfig = KvTransferConfig(),
                     decode_transfer: KvTransferConfig = KvTransferConfig()) -> Pair:
    bus, bus_config = module_bus
    assert not vllm_processes(), "another vLLM engine runs under this test process"
    last_core = (os.cpu_count() or 1) - 1
    prefill = await start_vllm_worker(worker_config("prefill", bus_config, model_dir, prefill_transfer), 0, bus)
    try:
        decode = await start_vllm_worker(worker_config("decode", bus_config, model_dir, decode_transfer),
                                         min(1, last_core), bus)
    except BaseException:
        await prefill.service.stop()
        raise
    pair = Pair(bus, bus_config, prefill, decode)
    codec: Codec[TransferRecord] = Codec(TransferRecord)

    async def on_record(msg) -> None:
        pair.records.append(codec.decode(msg.data))

    pair.subscription = await bus.client.subscribe(bus_config.subjects.kv_transfers_all, cb=on_record)
    return pair


async def stop_pair(pair: Pair) -> None:
    await pair.subscription.unsubscribe()
    for worker in (pair.decode, pair.prefill):
        await worker.service.stop()  # stops the engine too
    assert not vllm_processes(), "a vLLM process outlived its engine"


@pytest.fixture(scope="class")
async def pair(request: pytest.FixtureRequest, module_bus: tuple[Bus, BusConfig], model_dir: str) -> AsyncIterator[Pair]:
    """The test class's two engines, each reading with the class's `prefill_transfer` /
    `decode_transfer` (a clean transport where the class names none)."""
    nodes = await start_pair(module_bus, model_dir,
                             prefill_transfer=getattr(request.cls, "prefill_transfer", KvTransferConfig()),
                             decode_transfer=getattr(request.cls, "decode_transfer", KvTransferConfig()))
    try:
        yield nodes
    finally:
        await stop_pair(nodes)


# Shorter than a block, exact multiples, one past, several blocks; the decode prompt is one longer.
LENGTHS = [5, 60, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 385, 450, 511, 512, 600, 640, 700, 768, 900,
           1000]


class TestPullPath:
    async def test_disaggregated_output_equals_single_engine(self, pair: Pair) -> None:
        for index, length in enumerate(LENGTHS):
            prompt = prompt_of(1000 + index, length)
            p_done, d_done, computed_before = await pair.against_alone(prompt)
            full, partial = divmod(length, BLOCK)
            handle = p_done.kv_handle  # the full blocks and the partial last one (alone if shorter than a block)
            assert handle is not None, f"prompt of {length}"
            assert len(handle.block_ids) == full and handle.block_hashes == block_hash_chain(prompt, BLOCK)
            assert (handle.tail.tokens if handle.tail is not None else 0) == partial
            assert (d_done.pulled_tokens, d_done.recomputed_tokens) == (length, 0), f"prompt of {length}"
            # vLLM's own counters: the decode worker computed what no held block covers (the first token).
            await pair.decode_computed(computed_before, 1, f"vLLM counted the rest of the {length}-token prompt")
            assert d_done.cached_tokens == length
        await pair.assert_clean()
        expected_pulls = len(LENGTHS)
        # a pull's record goes out when the holder answered its release, maybe after the request ended
        await wait_for(lambda: sum(r.kind == "pull" for r in pair.records) >= expected_pulls, 10, "every pull's record")
        pulls = [r for r in pair.records if r.kind == "pull"]
        assert len(pulls) == expected_pulls
        assert all(r.outcome == "done" and r.bytes > 0 and r.recomputed_tokens == 0 for r in pulls)
        assert pair.prefill.kv.holder.leases.outcomes["done"] == len(pulls)


    async def test_repeated_pull_reads_only_what_is_not_cached(self, pair: Pair) -> None:
        prompt = prompt_of(2000, 600)
        seen = len(pair.records)
        await pair.disaggregated(prompt, 4)
        extended = prompt + prompt_of(2001, 300)  # the decode worker caches the first 4 blocks already
        expected, _ = await pair.generate(pair.prefill, extended, 4)
        got, p_done, d_done = await pair.disaggregated(extended, 4)
        assert got == expected
        handle = p_done.kv_handle
        assert handle is not None and len(handle.block_ids) == 7 and handle.tail is not None
        assert handle.tail.tokens == 900 - 7 * BLOCK
        # 3 full blocks and the partial one read; vLLM counts the 4 cached ones too
        assert d_done.pulled_tokens == 900 - 4 * BLOCK and d_done.cached_tokens == 900
        # 600 tokens: 4 full blocks and a partial one; 900: 3 more and a partial one
        assert sorted(r.blocks for r in await pair.records_since(seen, 2)) == [4, 5]
        await pair.assert_clean()


    async def test_vllm_and_sim_workers_refuse_each_other(self, pair: Pair) -> None:
        """Same model name and block size, different engines: different compatibility hashes,
        so each side refuses the other's blocks before any byte moves."""
        sim_config = WorkerConfig(worker_id="sim", bus=pair.bus_config, block_size=BLOCK, kv_blocks=64,
                                  membership=MembershipConfig(heartbeat_interval_s=0.2, ttl_s=2.0))
        sim_engine = SimEngine(sim_config, SimEngineConfig(speedup=50), model_name="tiny", vocab_size=2048)
        await sim_engine.start()
        sim = WorkerService(sim_config, sim_engine, pair.bus, WorkerKv(
            sim_config, pair.bus, sim_engine, build_rank_transports(sim_config, sim_engine),
            compat_hash=sim_engine.info.compat_hash))
        await sim.start()
        sim_worker = VllmWorker(sim_config, sim_engine, sim.kv, sim)  # type: ignore[arg-type]
        try:
            assert sim_engine.info.compat_hash != pair.prefill.engine.info.compat_hash
            prompt = prompt_of(3000, 300)
            records = len(pair.records)
            # sim blocks offered to a vLLM worker
            _, sim_done = await pair.generate(sim_worker, prompt, 1, KvTransferParams(hold_for_decode=True))
            assert sim_done.kv_handle is not None
            with pytest.raises(InvalidArgument, match="mismatch"):
                await pair.generate(pair.decode, prompt + [5], 4, KvTransferParams(source=sim_done.kv_handle))
            await wait_for(lambda: sim.kv.holder.leases.outcomes["refused"] == 1, 5, "the sim lease refused")
            # vLLM blocks offered to a sim worker
            _, vllm_done = await pair.generate(pair.prefill, prompt, 1, KvTransferParams(hold_for_decode=True))
            assert vllm_done.kv_handle is not None
            with pytest.raises(InvalidArgument, match="mismatch"):
                await pair.generate(sim_worker, prompt + [5], 4, KvTransferParams(source=vllm_done.kv_handle))
            await wait_for(lambda: pair.prefill.kv.holder.leases.outcomes["refused"] == 1, 5, "the vLLM lease refused")
            # a sim worker asking a vLLM holder for a prefix lease
            reply = await pair.bus.client.request(
                pair.bus_config.subjects.kv_lease(pair.prefill.config.worker_id),
                encode(LeaseRequest(requester_worker_id="sim", compat_hash=sim_engine.info.compat_hash,
                                    block_hashes=block_hash_chain(prompt, BLOCK), ttl_s=5.0)), timeout=5)
            refused = Codec(LeaseReply).decode(reply.data)
            assert isinstance(refused, LeaseRefused) and "mismatch" in refused.reason
            assert len(pair.records) == records  # no transfer was even attempted
            await pair.assert_clean()
            assert sim.kv.active_leases == 0
        finally:
            await sim.stop()

    async def test_prefix_pull_from_a_holder_computes_only_new_tokens(self, pair: Pair) -> None:
        turn1 = prompt_of(4000, 400)
        out1, _ = await pair.generate(pair.decode, turn1, 40)  # the decode worker holds the conversation
        turn2 = turn1 + out1 + prompt_of(4001, 30)
        expected, _ = await pair.generate(pair.decode, turn2, 8)
        held = len(block_hash_chain(turn1 + out1[:-1], BLOCK))  # the last generated token has no KV yet
        await wait_for(lambda: len(pair.decode.engine.kv_event_bridge.mirror.prefix_tokens(
            block_hash_chain(turn2, BLOCK))) >= held * BLOCK, 5, "the holder's KV events")
        computed_before = pair.prefill.engine.stats.computed_prompt_tokens_total
        seen = len(pair.records)
        # The router's turn 2 on a prefill worker: pull the prefix, compute the rest, hold it all.
        got, done = await pair.generate(pair.prefill, turn2, 8, KvTransferParams(
            prefix_holder=pair.decode.config.worker_id, prefix_hashes=block_hash_chain(turn2, BLOCK),
            hold_for_decode=True))
        assert got == expected
        assert done.pulled_tokens == held * BLOCK and done.recomputed_tokens == 0
        await wait_for(lambda: pair.prefill.engine.stats.computed_prompt_tokens_total - computed_before
                       == len(turn2) - held * BLOCK, 5, "vLLM counted only the new tokens")
        [record] = await pair.records_since(seen)
        assert record.kind == "prefix_pull" and record.outcome == "done"
        # The decode worker caches every full block of turn 2 already: it reads only the
        # partial last block.
        handle = done.kv_handle
        assert handle is not None and len(handle.block_ids) == len(turn2) // BLOCK
        assert handle.tail is not None and handle.tail.tokens == len(turn2) % BLOCK > 0
        rest, d_done = await pair.generate(pair.decode, turn2 + got[:1], 7, KvTransferParams(source=handle))
        assert rest == expected[1:]
        assert d_done.pulled_tokens == len(turn2) % BLOCK and d_done.recomputed_tokens == 0
        await wait_for(lambda: pair.records[-1].kind == "pull", 5, "the decode worker's record")
        assert (pair.records[-1].outcome, pair.records[-1].blocks) == ("done", 1)
        await pair.assert_clean()


    async def test_idle_engines_with_the_connector_use_little_cpu(self, pair: Pair) -> None:
        await pair.assert_clean()
        processes = vllm_processes()
        assert len(processes) == 4  # EngineCore and model worker of each engine
        await wait_for(cpu_quiet(processes), 20, "vLLM's processes to go quiet after the last request")
        before = {p.pid: p.cpu_times() for p in processes}
        await asyncio.sleep(10.0)  # the measurement window: CPU used while idle, not a wait for anything
        for process in processes:
            start, end = before[process.pid], process.cpu_times()
            used = (end.user + end.system) - (start.user + start.system)
            print(f"idle CPU over 10 s: {process.name()} ({process.pid}): {used:.3f} s")
            assert used < 1.0, f"{process.name()} ({process.pid}) used {used:.2f}s of CPU in 10s idle"


# The decode worker's reads fail or arrive corrupted for blocks chosen by the holder's block id
# (as connector.faults chooses them). The prefill worker's reads start 2 s late and it asks
# for 1 s leases, so when it pulls a prefix from the decode worker it outlives its lease.
READ_FAULTS = KvFaultConfig(fail_fraction=0.15, corrupt_fraction=0.1, seed=3)
SLOW_READS = KvTransferConfig(faults=KvFaultConfig(delay_s=2.0), lease_ttl_s=1.0)


def injected_failures(handle: KvHandle) -> list[int]:
    """Indices of the handle's blocks (its partial last one included) the decode worker's reads break."""
    return [index for index, block_id in enumerate(held_block_ids(handle))
            if chosen(READ_FAULTS.seed, "fail", block_id, READ_FAULTS.fail_fraction)
            or chosen(READ_FAULTS.seed, "corrupt", block_id, READ_FAULTS.corrupt_fraction)]


def held_block_ids(handle: KvHandle) -> list[int]:
    return handle.block_ids + ([handle.tail.block_id] if handle.tail is not None else [])


def tokens_in(handle: KvHandle, blocks: int) -> int:
    """Prompt tokens in the handle's first `blocks` blocks, its partial last one included."""
    return min(blocks * BLOCK, handle.num_tokens)


class TestFaults:
    prefill_transfer = SLOW_READS
    decode_transfer = KvTransferConfig(faults=READ_FAULTS)

    async def test_failed_blocks_are_recomputed_and_output_is_identical(self, pair: Pair) -> None:
        decode = pair.decode
        clean = tail_only = mid_prompt = 0
        lengths = [300, 260, 400, 512, 384, 600, 290, 700, 768, 270, 900, 1000, 330, 640, 280, 500] * 2
        for index, length in enumerate(lengths):
            if index >= 10 and clean and tail_only and mid_prompt:
                break
            seen = len(pair.records)
            p_done, d_done, computed_before = await pair.against_alone(prompt_of(5000 + index, length))
            handle = p_done.kv_handle
            assert handle is not None
            blocks = len(held_block_ids(handle))
            failed = injected_failures(handle)
            # vLLM's computed prefix has no holes: it keeps the blocks before the first failure
            # and computes from there on.
            kept = failed[0] if failed else blocks
            pulled = tokens_in(handle, kept)
            assert (d_done.pulled_tokens, d_done.recomputed_tokens) == (pulled, length - pulled)
            [record] = await pair.records_since(seen)
            assert (record.outcome, record.blocks, record.blocks_ok) == (
                "failed" if failed else "done", blocks, kept)
            # permanent faults: every failed block was read once more, in vain
            assert (record.blocks_retried, record.blocks_recovered) == (len(failed), 0)
            # vLLM's own counters of the prompt tokens it prefilled and took as cached.
            assert d_done.cached_tokens == pulled
            await pair.decode_computed(computed_before, length + 1 - pulled,
                                       f"vLLM counted the recomputation ({length} tokens)")
            if not failed:
                clean += 1
            elif failed == list(range(kept, blocks)):
                tail_only += 1  # exactly the failed blocks were recomputed
            else:
                mid_prompt += 1  # good blocks after a failed one were recomputed too
        assert clean and tail_only and mid_prompt, (clean, tail_only, mid_prompt)
        assert decode.kv.totals.recomputed_tokens == sum(r.recomputed_tokens for r in pair.records)
        assert decode.kv.totals.recomputed_blocks == sum(r.blocks - r.blocks_ok for r in pair.records)
        assert decode.kv.totals.retried_blocks == sum(r.blocks_retried for r in pair.records) > 0
        assert decode.kv.totals.recovered_blocks == 0
        assert pair.prefill.kv.holder.leases.outcomes["failed"] == tail_only + mid_prompt
        await pair.assert_clean()

    async def test_lease_expiring_during_a_slow_pull_is_explicit_and_safe(self, pair: Pair) -> None:
        turn1 = prompt_of(6000, 500)
        out1, _ = await pair.generate(pair.decode, turn1, 20)
        turn2 = turn1 + out1 + prompt_of(6001, 20)
        expected, _ = await pair.generate(pair.decode, turn2, 8)
        held = len(block_hash_chain(turn1 + out1[:-1], BLOCK))
        await wait_for(lambda: len(pair.decode.engine.kv_event_bridge.mirror.prefix_tokens(
            block_hash_chain(turn2, BLOCK))) >= held * BLOCK, 5, "the holder's KV events")
        got, done = await pair.generate(pair.prefill, turn2, 8, KvTransferParams(
            prefix_holder=pair.decode.config.worker_id, prefix_hashes=block_hash_chain(turn2, BLOCK)))
        assert got == expected
        # The blocks stayed cached (unreferenced) on the holder: each one verified against the
        # checksum taken when the lease was granted, so they were used; the record says the
        # lease had expired, and the holder's lease table too.
        assert done.pulled_tokens == held * BLOCK
        await wait_for(lambda: pair.records and pair.records[-1].kind == "prefix_pull", 5, "the record")
        assert pair.records[-1].outcome == "expired"
        assert pair.decode.kv.holder.leases.outcomes["expired"] == 1
        await pair.assert_clean()


# The same choice of blocks, but each fails (or arrives corrupted) only on its first read.
TRANSIENT_READ_FAULTS = KvFaultConfig(fail_fraction=0.15, corrupt_fraction=0.1, fail_times=1, seed=3)


class TestRetry:
    decode_transfer = KvTransferConfig(faults=TRANSIENT_READ_FAULTS)

    async def test_transient_failures_are_read_again_and_nothing_is_recomputed(self, pair: Pair) -> None:
        decode = pair.decode
        for index, length in enumerate([300, 512, 700, 900, 1000]):
            seen = len(pair.records)
            p_done, d_done, computed_before = await pair.against_alone(prompt_of(7000 + index, length))
            assert p_done.kv_handle is not None
            blocks = len(held_block_ids(p_done.kv_handle))
            assert (d_done.pulled_tokens, d_done.recomputed_tokens) == (length, 0)
            [record] = await pair.records_since(seen)
            assert (record.outcome, record.blocks_ok) == ("done", blocks)
            assert record.blocks_retried == record.blocks_recovered
            # vLLM computed only what no block covers (the first token)
            await pair.decode_computed(computed_before, 1, f"vLLM's count ({length} tokens)")
        assert decode.kv.totals.retried_blocks == decode.kv.totals.recovered_blocks == sum(
            r.blocks_retried for r in pair.records) > 0, "the injection should have failed some blocks"
        assert decode.kv.totals.recomputed_blocks == decode.kv.totals.recomputed_tokens == 0
        await pair.assert_clean()
