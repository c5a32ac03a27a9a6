"""KV hand-off between two workers (real sim engines, real NATS, the real holder and puller),
over each KV transport: NIXL agents, and the in-memory transport (workers of one process,
no NIXL needed): P/D pull, partial failures, corruption, lease expiry, compatibility
refusal, prefix pull, push mode.

Each case ends with zero active leases and every KV pool back to its baseline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from connector.push import PushWriter
from connector.sim.worker_kv import WorkerKv
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.block_hash import block_hash_chain
from shared.bus import Bus
from shared.config import BusConfig, KvFaultConfig
from shared.errors import InvalidArgument
from shared.schemas import (
    GenerateRequest,
    KvTransferParams,
    PushDone,
    PushTarget,
    SamplingParams,
    TransferRecord,
)
from tests.integration.kv_cluster import (
    BLOCK,
    TRANSPORTS,
    Cluster,
    prompts,
    push_disaggregated,
    start_worker,
    transport_cluster,
    worker_config,
)


@pytest.fixture(params=TRANSPORTS)
async def cluster(bus: Bus, bus_config: BusConfig, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async for nodes in transport_cluster(bus, bus_config, request.param):
        yield nodes


async def test_pull_gives_identical_output_and_computes_only_the_tail(cluster: Cluster) -> None:
    await cluster.add("single")
    await cluster.add("prefill")
    await cluster.add("decode")
    for prompt in prompts():
        expected, _ = await cluster.generate("single", prompt, 12)
        got, p_done, d_done = await cluster.disaggregated("prefill", "decode", prompt, 12)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        full_blocks = len(prompt) // BLOCK
        handle = p_done.kv_handle
        assert (handle is None) == (full_blocks == 0)
        if handle is not None:
            assert len(handle.block_ids) == full_blocks
            assert d_done.pulled_tokens == full_blocks * BLOCK and d_done.recomputed_tokens == 0
    await cluster.assert_clean()
    pulls = [r for r in cluster.records if r.kind == "pull"]
    assert pulls and all(r.outcome == "done" and r.bytes > 0 for r in pulls if r.blocks)


@pytest.mark.parametrize("fault", [KvFaultConfig(fail_fraction=0.3, seed=1), KvFaultConfig(corrupt_fraction=0.3, seed=2)],
                         ids=["failed-blocks", "corrupted-blocks"])
async def test_partial_failure_recomputes_only_failed_blocks(cluster: Cluster, fault: KvFaultConfig) -> None:
    await cluster.add("single")
    await cluster.add("prefill")
    decode = await cluster.add("decode", faults=fault)
    failed_blocks = 0
    for prompt in prompts():
        expected, _ = await cluster.generate("single", prompt, 8)
        before = decode.engine.load().computed_prompt_tokens_total
        got, p_done, d_done = await cluster.disaggregated("prefill", "decode", prompt, 8)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        computed = decode.engine.load().computed_prompt_tokens_total - before
        tail = len(prompt) + 1 - (len(prompt) // BLOCK) * BLOCK  # partial block + the first token
        assert computed == d_done.recomputed_tokens + tail
        failed_blocks += d_done.recomputed_tokens // BLOCK
    assert failed_blocks > 0, "the injection should have failed some blocks"
    recomputed = sum(r.recomputed_tokens for r in cluster.records)
    assert recomputed == failed_blocks * BLOCK == decode.kv.totals.recomputed_tokens
    await cluster.assert_clean()


async def test_whole_transfer_failure_still_answers_correctly(cluster: Cluster) -> None:
    await cluster.add("single")
    await cluster.add("prefill")
    await cluster.add("decode", faults=KvFaultConfig(fail_transfer=True))
    prompt = prompts()[-1]
    expected, _ = await cluster.generate("single", prompt, 8)
    got, _, d_done = await cluster.disaggregated("prefill", "decode", prompt, 8)
    assert got == expected and d_done.pulled_tokens == 0
    assert d_done.recomputed_tokens == (len(prompt) // BLOCK) * BLOCK
    assert cluster.records[-1].outcome == "failed"
    await cluster.assert_clean()


async def test_lease_expiring_before_the_pull_is_explicit_and_safe(cluster: Cluster) -> None:
    await cluster.add("single")
    prefill = await cluster.add("prefill", lease_ttl_s=0.2)
    await cluster.add("decode", faults=KvFaultConfig(delay_s=0.6))
    prompt = prompts()[-1]
    expected, _ = await cluster.generate("single", prompt, 8)
    got, _, d_done = await cluster.disaggregated("prefill", "decode", prompt, 8)
    assert got == expected
    assert d_done.pulled_tokens == 0  # nothing read after the lease ended is trusted
    assert cluster.records[-1].outcome == "expired"
    assert prefill.kv.holder.leases.outcomes["expired"] == 1
    await cluster.assert_clean()


async def test_incompatible_workers_refuse_before_any_byte_moves(cluster: Cluster) -> None:
    prefill = await cluster.add("prefill")
    await cluster.add("other", model="other-model")  # another model: another compatibility hash
    prompt = prompts()[-1]
    _, p_done = await cluster.generate("prefill", prompt, 1, KvTransferParams(hold_for_decode=True))
    with pytest.raises(InvalidArgument, match="mismatch"):
        await cluster.generate("other", prompt + [5], 4, KvTransferParams(source=p_done.kv_handle),
                               model="other-model")
    assert prefill.kv.holder.leases.outcomes["refused"] == 1
    assert not [r for r in cluster.records if r.bytes]
    await cluster.assert_clean()


async def test_prefix_pull_computes_only_new_tokens(cluster: Cluster) -> None:
    await cluster.add("single")
    holder = await cluster.add("holder")
    puller = await cluster.add("puller")
    turn1 = prompts()[-1]
    out1, _ = await cluster.generate("holder", turn1, 40)
    turn2 = turn1 + out1 + [7, 8, 9, 10, 11]
    expected, _ = await cluster.generate("single", turn2, 8)
    hashes = block_hash_chain(turn2, BLOCK)
    before = puller.engine.load().computed_prompt_tokens_total
    got, done = await cluster.generate("puller", turn2, 8, KvTransferParams(prefix_holder="holder",
                                                                            prefix_hashes=hashes))
    assert got == expected
    held = len(block_hash_chain(turn1 + out1[:-1], BLOCK))  # the last generated token has no KV yet
    assert done.pulled_tokens == held * BLOCK
    computed = puller.engine.load().computed_prompt_tokens_total - before
    assert computed == len(turn2) - held * BLOCK
    assert cluster.records[-1].kind == "prefix_pull" and cluster.records[-1].outcome == "done"
    assert holder.kv.holder.leases.outcomes["done"] == 1
    await cluster.assert_clean()


async def test_a_prefix_pull_reads_the_holders_host_tier(cluster: Cluster) -> None:
    await cluster.add("single")
    holder = await cluster.add("holder", kv_blocks=16, kv_host_blocks=64)
    puller = await cluster.add("puller")
    prompt = prompts()[-1]  # 200 tokens: 12 full blocks
    hashes = block_hash_chain(prompt, BLOCK)
    await cluster.generate("holder", prompt, 4)
    await cluster.generate("holder", [9 + (i * 5) % 500 for i in range(200)], 4)  # pushes most to the host tier
    blocks = holder.engine.scheduler.blocks
    on_device = len(blocks.match_prefix(hashes))  # the prompt's first blocks, evicted last
    assert on_device < len(hashes) // 2 and all(blocks.in_host(block_hash) for block_hash in hashes[on_device:])
    expected, _ = await cluster.generate("single", prompt, 8)
    before = puller.engine.load().computed_prompt_tokens_total
    got, done = await cluster.generate("puller", prompt, 8, KvTransferParams(prefix_holder="holder",
                                                                             prefix_hashes=hashes))
    assert got == expected and done.pulled_tokens == len(hashes) * BLOCK
    assert puller.engine.load().computed_prompt_tokens_total - before == len(prompt) - len(hashes) * BLOCK
    assert cluster.records[-1].kind == "prefix_pull" and cluster.records[-1].outcome == "done"
    assert len(blocks.match_prefix(hashes)) == len(hashes)  # loaded back into the holder's device tier
    await cluster.assert_clean()


def test_records_round_trip() -> None:
    record = TransferRecord(worker_id="w", request_id="r", kind="pull", peer_worker_id="p", outcome="done",
                            blocks=1, blocks_ok=1, bytes=1, duration_s=0.1, pulled_tokens=16, recomputed_tokens=0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=TransferRecord) == record


@pytest.mark.parametrize("speedup", [1.0])
async def test_push_writes_layers_while_computing(cluster: Cluster, bus: Bus, bus_config: BusConfig,
                                                  speedup: float, monkeypatch: pytest.MonkeyPatch) -> None:
    await cluster.add("single")
    prefill = await start_worker(cluster.config("prefill"), bus, sim=SimEngineConfig(speedup=speedup))
    cluster.workers["prefill"] = prefill
    await cluster.add("decode")
    for prompt in prompts():
        expected, _ = await cluster.generate("single", prompt, 10)
        got, d_done = await push_disaggregated(cluster, "prefill", "decode", prompt, 10)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        assert d_done.pulled_tokens == (len(prompt) // BLOCK) * BLOCK and d_done.recomputed_tokens == 0

    # a long prompt prefilled in several chunks: layer l of a chunk is on the wire while
    # layer l + 1 is still being computed
    long_prompt = [3 + (i * 11) % 500 for i in range(1200)]
    expected, _ = await cluster.generate("single", long_prompt, 4)
    writers: list[PushWriter] = []  # the prefill's push writers: their per-layer timings
    open_writer = prefill.kv.push_writer

    def recorded_writer(request: GenerateRequest, target: PushTarget) -> PushWriter:
        writers.append(open_writer(request, target))
        return writers[-1]

    monkeypatch.setattr(prefill.kv, "push_writer", recorded_writer)
    got, _ = await push_disaggregated(cluster, "prefill", "decode", long_prompt, 4)
    assert got == expected
    timings = writers[-1].timings
    layered = [t for t in timings if t.layer is not None]
    print("\npush timings (ms since the push began): layer, blocks, computed, written")
    for t in timings:
        print(f"  {t.layer!s:>4} {t.blocks:>4} {t.queued_s * 1e3:9.2f} {t.done_s * 1e3:9.2f}")
    layers = prefill.engine.info.layout.num_layers
    assert len(layered) >= 2 * layers  # several prefill chunks, every layer of each
    computed_at = sorted(t.queued_s for t in layered)
    overlapped = [t for t in layered if t.layer < layers - 1 and t.done_s < computed_at[-1]]
    assert overlapped, "no layer was written before prefill finished computing"
    assert all(t.ok for t in timings)
    await cluster.assert_clean()


async def test_push_with_failed_blocks_recomputes_only_them(cluster: Cluster) -> None:
    await cluster.add("single")
    await cluster.add("prefill", faults=KvFaultConfig(fail_fraction=0.3, seed=3))
    await cluster.add("decode")
    recomputed = 0
    for prompt in prompts():
        expected, _ = await cluster.generate("single", prompt, 6)
        got, d_done = await push_disaggregated(cluster, "prefill", "decode", prompt, 6)
        assert got == expected
        recomputed += d_done.recomputed_tokens
    assert recomputed > 0
    assert recomputed == sum(r.recomputed_tokens for r in cluster.records if r.kind == "push")
    await cluster.assert_clean()


async def test_a_push_receiver_nobody_waits_on_gives_its_blocks_back(bus: Bus, bus_config: BusConfig) -> None:
    """The decode side allocated a push's target blocks, then its request failed before it
    waited for the writer (its target never reached the router): the receiver expires after
    twice the push wait and unpins them (the same rule as vLLM's reader)."""
    async for nodes in transport_cluster(bus, bus_config, "memory"):
        decode = await nodes.add("decode", push_wait_s=0.2)
        request = GenerateRequest(request_id="never-awaited", model="tiny", token_ids=prompts()[-1],
                                  sampling=SamplingParams(max_tokens=2), kv_transfer=KvTransferParams(await_push=True))
        receiver = await decode.kv.push_receiver(request)
        assert len(receiver.target.block_ids) == len(prompts()[-1]) // BLOCK
        assert decode.engine.load().kv_used_blocks == len(receiver.target.block_ids)
        await nodes.assert_clean(timeout_s=2 * 0.2 + 5.0 + 3.0)
        decode.kv.deliver_push(PushDone(transfer_id="never-awaited", outcome="ok", checksums=[], first_token=1))
        assert not receiver.done.done(), "an expired receiver is no longer reachable"


async def test_concurrent_pulls_into_a_full_pool_never_deadlock(cluster: Cluster) -> None:
    """Four pulls of 8 blocks each into a 20-block pool: pulled blocks must not stay pinned
    while their requests wait for room, or the requests wait on each other for ever."""
    await cluster.add("single")
    await cluster.add("prefill")
    await cluster.add("decode", kv_blocks=20)
    batch = [[3 + (i * (n + 7) * 5) % 500 for i in range(128)] for n in range(4)]
    expected = [(await cluster.generate("single", prompt, 8))[0] for prompt in batch]
    results = await asyncio.wait_for(asyncio.gather(
        *(cluster.disaggregated("prefill", "decode", prompt, 8) for prompt in batch)), 30)
    assert [tokens for tokens, _, _ in results] == expected
    await cluster.assert_clean()


@pytest.mark.parametrize("stage", ["lease release", "record publish"])
async def test_a_pull_cancelled_after_its_read_leaves_no_block_pinned(cluster: Cluster, stage: str) -> None:
    """A client gone while the decode worker tells the holder the pull is done (or publishes
    its record): the request's task is cancelled there, and the blocks it pulled must not
    stay pinned (they would leak for the worker's lifetime)."""
    await cluster.add("prefill")
    decode = await cluster.add("decode")
    prompt = [3 + (i * 11) % 500 for i in range(100)]
    first, p_done = await cluster.generate("prefill", prompt, 1, KvTransferParams(hold_for_decode=True))
    reached = asyncio.Event()
    owner, name = (decode.kv.leases, "release") if stage == "lease release" else (decode.kv, "_publish")
    step = getattr(owner, name)

    async def watched(*args, **kwargs):
        reached.set()
        if stage == "record publish":  # a publish waits when the connection's pending buffer is full
            await asyncio.sleep(0.2)
        return await step(*args, **kwargs)  # a release waits for the holder's reply

    setattr(owner, name, watched)
    request = GenerateRequest(request_id="cancelled-pull", model="tiny", token_ids=prompt + first,
                              sampling=SamplingParams(max_tokens=4), kv_transfer=KvTransferParams(source=p_done.kv_handle))
    pull = asyncio.create_task(decode.kv.prepare(request))
    await asyncio.wait_for(reached.wait(), 5)
    pull.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pull
    await cluster.assert_clean()


async def test_the_memory_transport_needs_no_nixl(bus: Bus, bus_config: BusConfig,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's wiring asks for NIXL only when the config names the NIXL transport."""
    import connector.nixl_agent
    from services.worker.engines import engine_spec
    from services.worker.main import build_kv
    from shared.config import ConfigError

    monkeypatch.setattr(connector.nixl_agent, "nixl_available", lambda: False)
    spec = engine_spec("sim")
    for transport in ("memory", "nixl"):
        config = worker_config(f"w-{transport}", bus_config, transport=transport)
        engine = SimEngine(config, model_name="tiny", vocab_size=512)
        if transport == "nixl":
            with pytest.raises(ConfigError, match="NIXL"):
                build_kv(config, spec, engine, bus)
            continue
        kv = build_kv(config, spec, engine, bus)
        assert isinstance(kv, WorkerKv) and kv.agents.agent_name.startswith("w-memory-")
        await kv.stop()
