"""SimEngine: the Engine contract over asyncio (speed-up 1000 so tests run fast)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import numpy as np
import pytest

from connector.port import KvPort
from services.worker.engine import Engine, EngineOutput
from services.worker.request_runner import ReplayedTokens
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from services.worker.sim.profile import TimingProfile
from services.worker.sim.tokens import generate_tokens
from shared.block_hash import block_hash_chain
from shared.config import WorkerConfig
from shared.errors import InvalidArgument, TandemError, Unavailable
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import BlockStored
from tests.waiting import wait_for

VOCAB = 800


def config(**overrides) -> tuple[WorkerConfig, SimEngineConfig]:
    """A worker's config and its sim's (the `sim_` overrides: `sim_layers=3`)."""
    fields = dict(worker_id="w", block_size=16, kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=512, sim_speedup=1000.0, sim_layers=2, sim_kv_dim=8)
    fields.update(overrides)
    sim = {name.removeprefix("sim_"): fields.pop(name) for name in list(fields) if name.startswith("sim_")}
    return WorkerConfig(**fields), SimEngineConfig(**sim)


@asynccontextmanager
async def running_engine(**overrides) -> AsyncIterator[SimEngine]:
    engine = SimEngine(*config(**overrides), model_name="tiny", vocab_size=VOCAB)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def collect(engine: SimEngine, request_id: str, token_ids: list[int],
                  sampling: SamplingParams) -> list[EngineOutput]:
    return [output async for output in engine.generate(request_id, token_ids, sampling)]


PROMPT = [3 + (i * 37) % 700 for i in range(100)]


async def test_info_and_protocol() -> None:
    engine: Engine = SimEngine(*config(), model_name="tiny", vocab_size=VOCAB)
    for member in ("start", "stop", "generate", "abort", "load", "take_kv_events", "kv_snapshot"):
        assert callable(getattr(engine, member))
    info = engine.info
    assert (info.engine, info.model, info.block_size, info.kv_blocks, info.vocab_size) == ("sim", "tiny", 16, 64, VOCAB)
    assert (info.layout.num_layers, info.layout.head_size, info.layout.num_kv_heads) == (2, 2, 4)
    assert info.layout.dtype == "float16" and info.layout.engine == "sim"
    assert isinstance(engine, SimEngine) and engine.kv_pool.block_nbytes == 2 * 2 * 16 * 8 * 2
    with pytest.raises(Unavailable):
        engine.generate("r", PROMPT, SamplingParams())  # not started


async def test_two_engines_produce_identical_tokens() -> None:
    sampling = SamplingParams(max_tokens=24, temperature=0.9, seed=5)
    async with running_engine() as one, running_engine(max_num_batched_tokens=16, block_size=8) as two:
        first, second = await asyncio.gather(collect(one, "a", PROMPT, sampling), collect(two, "b", PROMPT, sampling))
    tokens = [t for output in first for t in output.token_ids]
    assert tokens == [t for output in second for t in output.token_ids]
    assert tokens == generate_tokens(PROMPT, sampling, VOCAB)[0]
    final = first[-1]
    assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == ("length", 100, 24)
    assert all(not output.finished for output in first[:-1])


async def test_repeated_prompt_reports_cached_tokens_and_events() -> None:
    async with running_engine() as engine:
        first = await collect(engine, "a", PROMPT, SamplingParams(max_tokens=4))
        second = await collect(engine, "b", PROMPT, SamplingParams(max_tokens=4))
        assert first[-1].cached_tokens == 0 and second[-1].cached_tokens == 96
        events = engine.take_kv_events()
        stored = [h for event in events if isinstance(event, BlockStored) for h in event.block_hashes]
        assert stored[:6] == block_hash_chain(PROMPT, 16)
        assert engine.take_kv_events() == []
        assert {h for event in engine.kv_snapshot() for h in event.block_hashes} == set(stored)
        load = engine.load()
        assert (load.running, load.kv_used_blocks, load.cached_tokens_total, load.generated_tokens_total) == (0, 0, 96, 8)


async def test_closing_the_generator_early_frees_blocks() -> None:
    async with running_engine() as engine:
        outputs = engine.generate("r", PROMPT, SamplingParams(max_tokens=400))
        first = await outputs.__anext__()
        assert first.token_ids and engine.load().kv_used_blocks > 0
        await outputs.aclose()
        load = engine.load()
        assert (load.running, load.waiting, load.kv_used_blocks) == (0, 0, 0)


async def test_cancelling_the_consumer_frees_blocks() -> None:
    async with running_engine() as engine:
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("r", PROMPT, SamplingParams(max_tokens=400)):
                seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 2.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.load().kv_used_blocks == 0 and engine.load().running == 0


async def test_invalid_request_raises_before_anything_is_queued() -> None:
    async with running_engine() as engine:
        with pytest.raises(InvalidArgument, match="maximum context length"):
            engine.generate("r", [5] * 600, SamplingParams())
        assert engine.load().waiting == 0


async def test_abort_and_stop_end_streams_with_abort() -> None:
    engine = SimEngine(*config(), model_name="tiny", vocab_size=VOCAB)
    await engine.start()
    long = SamplingParams(max_tokens=400)
    results: dict[str, list[EngineOutput]] = {}

    async def consume(request_id: str) -> None:
        results[request_id] = [output async for output in engine.generate(request_id, PROMPT, long)]

    tasks = [asyncio.create_task(consume(request_id)) for request_id in ("x", "y")]
    await wait_for(lambda: engine.load().generated_tokens_total >= 4, 2.0, "four tokens generated", interval_s=0.001)
    await engine.abort("x")
    await tasks[0]
    assert results["x"][-1].finish_reason == "abort"
    await engine.stop()
    await asyncio.wait_for(tasks[1], 2.0)
    assert results["y"][-1].finish_reason == "abort" and results["y"][-1].completion_tokens > 0
    assert engine.load().kv_used_blocks == 0
    with pytest.raises(Unavailable):
        engine.generate("z", PROMPT, long)


async def test_many_concurrent_requests_all_finish() -> None:
    prompts = {f"r{i}": PROMPT[i:i + 40] for i in range(12)}
    sampling = SamplingParams(max_tokens=30)
    async with running_engine(kv_blocks=20, max_num_seqs=6) as engine:
        results = await asyncio.gather(*(collect(engine, rid, text, sampling) for rid, text in prompts.items()))
        for (rid, text), outputs in zip(prompts.items(), results):
            assert [t for output in outputs for t in output.token_ids] == generate_tokens(text, sampling, VOCAB)[0]
            assert outputs[-1].finish_reason == "length"
        assert engine.scheduler.preemptions_total > 0  # 20 blocks cannot hold six 70-token sequences
        assert engine.load().kv_used_blocks == 0


# ---- the KV port -------------------------------------------------------------------------------

def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


async def test_kv_port_members_and_rank_regions() -> None:
    engine: KvPort = SimEngine(*config(sim_layers=3, tensor_parallel=2), model_name="tiny", vocab_size=VOCAB)
    for member in ("kv_shape", "kv_regions", "prompt_block_ids", "pin_prefix", "pin_blocks", "allocate_for_transfer",
                   "commit_transferred", "unpin", "block_checksums", "unit_checksums"):
        assert callable(getattr(engine, member))
    shape, regions = engine.kv_shape(), engine.kv_regions()
    assert (shape.block_size, shape.num_layers, shape.num_kv_heads, len(shape.ranks)) == (16, 3, 4, 2)
    assert [rank.heads for rank in shape.ranks] == [range(0, 2), range(2, 4)]
    for rank, region in zip(shape.ranks, regions):
        assert region.dtype == np.uint8 and region.ndim == 1 and region.flags.c_contiguous
        assert region.nbytes == rank.nbytes == 64 * rank.block_stride
        assert rank.block_stride == 3 * 2 * 2 * 16 * 2 * 2  # layers x heads x (K, V) x tokens x 2-dim head in fp16
    assert isinstance(engine, SimEngine) and engine.info.layout.tensor_parallel == 2


async def test_on_layer_gets_each_layer_of_each_prefill_step_before_the_outputs(monkeypatch) -> None:
    profile = TimingProfile(prefill_ms_per_token=1.0, step_overhead_ms=0.0, decode_base_ms=8.0,
                            decode_ms_per_seq=0.0, layer_weights=[1.0, 2.0, 1.0])
    engine = SimEngine(*config(sim_layers=3, max_num_batched_tokens=32, sim_speedup=1000.0), model_name="tiny",
                       vocab_size=VOCAB, profile=profile)
    log: list[tuple] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float, *args) -> None:
        if delay:
            log.append(("sleep", round(delay * 1e6)))  # microseconds
        await real_sleep(0)

    def on_layer(layer: int, block_ids: list[int]) -> None:
        log.append(("layer", layer, block_ids, engine.prompt_block_ids("r")))

    await engine.start()
    monkeypatch.setattr(asyncio, "sleep", recording_sleep)
    try:
        outputs = []
        async for output in engine.generate("r", PROMPT, SamplingParams(max_tokens=2), on_layer=on_layer):
            log.append(("output", output.token_ids))
            outputs.append(output)
    finally:
        monkeypatch.undo()
        await engine.stop()
    assert tokens_of(outputs) == generate_tokens(PROMPT, SamplingParams(max_tokens=2), VOCAB)[0]
    layers = [entry for entry in log if entry[0] == "layer"]
    # 100 tokens, 32 a step: three steps fill two blocks each, the 4-token tail fills none.
    assert [(entry[1], len(entry[2])) for entry in layers] == [(layer, 2) for _ in range(3) for layer in range(3)]
    for step in range(3):
        for layer in range(3):
            _, _, block_ids, prompt_blocks = layers[3 * step + layer]
            assert block_ids == prompt_blocks[2 * step:2 * step + 2]
    # A 32-token step takes 32 ms, i.e. 32 us at a speed-up of 1000, cut 1:2:1 across the layers.
    first = log.index(layers[0])
    assert log[first - 1:first + 5] == [("sleep", 8), layers[0], ("sleep", 16), layers[1], ("sleep", 8), layers[2]]
    assert max(index for index, entry in enumerate(log) if entry[0] == "layer") < log.index(("output", outputs[0].token_ids))
    assert engine.load().computed_prompt_tokens_total == 100


async def test_a_raising_on_layer_hook_fails_only_its_request() -> None:
    def broken(layer: int, block_ids: list[int]) -> None:
        raise RuntimeError("queue full")

    calls: list[int] = []
    other = PROMPT[50:]
    async with running_engine(sim_layers=2, max_num_batched_tokens=256) as engine:
        bad, good = await asyncio.gather(collect_hooked(engine, "bad", PROMPT, broken),
                                         collect_hooked(engine, "good", other, lambda layer, ids: calls.append(layer)),
                                         return_exceptions=True)
        assert isinstance(bad, TandemError) and "on_layer hook failed" in str(bad)
        assert tokens_of(good) == generate_tokens(other, SamplingParams(max_tokens=4), VOCAB)[0]
        assert calls == [0, 1]  # both prompts in one step: three full blocks of "good", two layers
        assert engine.load().kv_used_blocks == 0 and engine.load().running == 0


async def collect_hooked(engine: SimEngine, request_id: str, token_ids: list[int], hook) -> list[EngineOutput]:
    return [output async for output in engine.generate(request_id, token_ids, SamplingParams(max_tokens=4),
                                                       on_layer=hook)]


async def test_a_pull_between_two_engines_gives_the_same_tokens_and_corrupt_kv_does_not() -> None:
    sampling = SamplingParams(max_tokens=8)
    hashes = block_hash_chain(PROMPT, 16)  # six full blocks, a 4-token tail
    async with running_engine() as holder, running_engine() as reader:
        expected = tokens_of(await collect(holder, "h", PROMPT, sampling))
        handle = holder.pin_prefix(hashes)
        assert len(handle) == 6
        target = reader.allocate_for_transfer(len(handle))
        assert target is not None
        for source_id, target_id in zip(handle, target):  # what a NIXL READ does
            reader.kv_pool.block_view(target_id)[:] = holder.kv_pool.block_view(source_id)
        ours, theirs = reader.block_checksums(target), holder.block_checksums(handle)
        ok = [ours[index * 4:(index + 1) * 4] == theirs[index * 4:(index + 1) * 4] for index in range(6)]
        holder.unpin(handle)
        assert reader.commit_transferred(target, 0, PROMPT, ok) == [True] * 6
        outputs = []
        async for output in reader.generate("r", PROMPT, sampling):
            if not outputs:
                reader.unpin(target)  # admitted: the request holds its own references now
            outputs.append(output)
        assert tokens_of(outputs) == expected and outputs[-1].cached_tokens == 96
        assert reader.load().computed_prompt_tokens_total == 4  # the tail only

        corrupt_block = reader.scheduler.blocks.match_prefix(hashes)[3]
        reader.kv_pool.block_view(corrupt_block)[10] ^= 0x40
        assert not reader.kv_pool.verify_block(corrupt_block, *reader.scheduler.blocks.content(corrupt_block))
        corrupt = tokens_of(await collect(reader, "r2", PROMPT, sampling))
        assert len(corrupt) == 8 and corrupt != expected
        assert reader.load().kv_used_blocks == 0 and holder.load().kv_used_blocks == 0


async def test_replayed_tokens_come_first_and_the_rest_follows_them_as_on_one_engine() -> None:
    sampling = SamplingParams(max_tokens=12, temperature=0.9, seed=5)
    async with running_engine() as engine:
        whole = [t for output in await collect(engine, "whole", PROMPT, sampling) for t in output.token_ids]
        replayed = msgspec.structs.replace(sampling, replayed=whole[:3])
        outputs = await collect(engine, "replay", PROMPT, replayed)
    assert [t for output in outputs for t in output.token_ids] == whole  # made again, then the same rest
    assert outputs[-1].completion_tokens == 12
    kept = ReplayedTokens(3)  # what the worker sends of them: the rest only, counted as such
    sent = [kept.left_out(output) for output in outputs]
    assert [t for output in sent for t in output.token_ids] == whole[3:] and sent[-1].completion_tokens == 9
