"""SimEngine: the Engine contract over asyncio (speed-up 1000 so tests run fast)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from services.worker.engine import Engine, EngineOutput
from services.worker.sim.engine import SimEngine
from services.worker.sim.tokens import generate_tokens
from shared.block_hash import block_hash_chain
from shared.config import WorkerConfig
from shared.errors import InvalidArgument, Unavailable
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import BlockStored

VOCAB = 800


def config(**overrides) -> WorkerConfig:
    fields = dict(worker_id="w", block_size=16, kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                  max_model_len=512, sim_speedup=1000.0, sim_layers=2, sim_kv_dim=8)
    fields.update(overrides)
    return WorkerConfig(**fields)


@asynccontextmanager
async def running_engine(**overrides) -> AsyncIterator[SimEngine]:
    engine = SimEngine(config(**overrides), model_name="tiny", vocab_size=VOCAB)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def collect(engine: SimEngine, request_id: str, token_ids: list[int],
                  sampling: SamplingParams) -> list[EngineOutput]:
    return [output async for output in engine.generate(request_id, token_ids, sampling)]


async def wait_until(condition, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


PROMPT = [3 + (i * 37) % 700 for i in range(100)]


async def test_info_and_protocol() -> None:
    engine: Engine = SimEngine(config(), model_name="tiny", vocab_size=VOCAB)
    for member in ("start", "stop", "generate", "abort", "load", "take_kv_events", "kv_snapshot"):
        assert callable(getattr(engine, member))
    info = engine.info
    assert (info.engine, info.model, info.block_size, info.kv_blocks, info.vocab_size) == ("sim", "tiny", 16, 64, VOCAB)
    assert (info.layout.num_layers, info.layout.head_size, info.layout.num_kv_heads) == (2, 8, 1)
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
    engine = SimEngine(config(), model_name="tiny", vocab_size=VOCAB)
    await engine.start()
    long = SamplingParams(max_tokens=400)
    results: dict[str, list[EngineOutput]] = {}

    async def consume(request_id: str) -> None:
        results[request_id] = [output async for output in engine.generate(request_id, PROMPT, long)]

    tasks = [asyncio.create_task(consume(request_id)) for request_id in ("x", "y")]
    await wait_until(lambda: engine.load().generated_tokens_total >= 4)
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
