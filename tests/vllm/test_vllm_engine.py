"""`VllmEngine` on a real vLLM (CPU) with the tiny generated Llama.

One engine for the whole module (start-up is ~20 s and ~2.5 GB): tests use distinct
prompts so they do not share cached blocks, and each leaves the engine idle. Skipped when
vLLM is not installed in the running venv (see services/worker/vllm/requirements-cpu.txt).
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv "
                                   "(install services/worker/vllm/requirements-cpu.txt)")
psutil = pytest.importorskip("psutil")

from services.worker.engine import EngineOutput  # noqa: E402
from services.worker.service import WorkerService  # noqa: E402
from services.worker.vllm.engine import VllmEngine  # noqa: E402
from services.worker.vllm.options import VllmEngineOptions  # noqa: E402
from shared.block_hash import ROOT_PARENT, block_hash_chain  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.codec import Codec  # noqa: E402
from shared.config import BusConfig, MembershipConfig, WorkerConfig  # noqa: E402
from shared.errors import InvalidArgument  # noqa: E402
from shared.request_plane import open_stream  # noqa: E402
from shared.schemas import GenerateRequest, KvEventBatch, LoadSnapshot, WorkerRegistration  # noqa: E402
from shared.schemas.generate import SamplingParams  # noqa: E402
from shared.schemas.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    token_ids_of,
)
from tests.waiting import wait_for  # noqa: E402

BLOCK = 128
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(length)]  # ids 0-2 are <unk>, <s>, </s>


DEADLINE_S = 30.0


def _vllm_processes() -> list[int]:
    """vLLM's EngineCore and model-worker processes under this one (named by setproctitle)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith("VLLM") and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
async def engine(tiny_model_dir: str) -> AsyncIterator[VllmEngine]:
    assert not _vllm_processes(), "another vLLM engine runs under this test process"
    # Pin the model worker's threads to the last core; the rest of the box stays usable.
    options = VllmEngineOptions(model_dir=tiny_model_dir, max_model_len=1024, max_num_seqs=8,
                                max_num_batched_tokens=512, kv_cache_gib=0.25,
                                cpu_threads_bind=str((os.cpu_count() or 1) - 1))
    vllm_engine = VllmEngine(options)
    environment = dict(os.environ)
    await vllm_engine.start()
    assert dict(os.environ) == environment, "vLLM's environment changes leaked into the worker"
    assert len(_vllm_processes()) == 2  # EngineCore and one model worker
    try:
        yield vllm_engine
    finally:
        await vllm_engine.stop()
        assert not _vllm_processes(), "stop() returned with vLLM processes still running"


class _EventLog:
    """Every KV event taken from the engine so far (tests share one engine)."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []

    def drain(self, engine: VllmEngine) -> list[KvEvent]:
        self.events.extend(engine.take_kv_events())
        return self.events


@pytest.fixture(scope="module")
def event_log() -> _EventLog:
    return _EventLog()


async def _run(engine: VllmEngine, request_id: str, prompt: list[int],
               sampling: SamplingParams = GREEDY) -> tuple[list[int], EngineOutput]:
    tokens: list[int] = []
    final: EngineOutput | None = None
    async for output in engine.generate(request_id, prompt, sampling):
        tokens.extend(output.token_ids)
        final = output
    assert final is not None and final.finished
    return tokens, final


def _tandem_chains(events: list[KvEvent]) -> set[int]:
    """Tandem's hash of every stored block, chained through the events' parent links."""
    tandem_of: dict[int, int] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            tandem_of.clear()
        elif isinstance(event, BlockStored):
            token_ids = token_ids_of(event)  # as the engine made them, or packed on the wire
            assert event.block_size == BLOCK and len(token_ids) == BLOCK * len(event.block_hashes)
            if event.parent_block_hash is None:
                parent = ROOT_PARENT
            elif event.parent_block_hash in tandem_of:
                parent = tandem_of[event.parent_block_hash]
            else:
                continue  # its parent was announced in events another test took
            chain = block_hash_chain(token_ids, BLOCK, parent_hash=parent)
            tandem_of.update(zip(event.block_hashes, chain, strict=True))
        elif isinstance(event, BlockRemoved):
            for block_hash in event.block_hashes:
                tandem_of.pop(block_hash, None)
    return set(tandem_of.values())


async def test_info_reports_vllm_layout(engine: VllmEngine) -> None:
    info = engine.info
    assert info.engine == "vllm" and info.model == "tiny"
    assert info.block_size == BLOCK  # vLLM-CPU's default block size
    layout = info.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_size) == (2, 2, 32)
    assert layout.dtype == "bfloat16"  # vLLM-CPU runs the float32 checkpoint as bfloat16
    assert info.vocab_size == 2048 and info.max_model_len == 1024 and info.max_num_seqs == 8
    assert info.kv_blocks > 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind an engine to fewer")
async def test_the_engines_processes_run_on_its_bound_core(engine: VllmEngine) -> None:
    """vLLM's EngineCore waits for its model worker's every step in a busy loop: started on
    the engine's core it yields that core to the model worker instead of taking another
    engine's (`services.worker.vllm.environment`). This process's threads keep its cores."""
    bound = {(os.cpu_count() or 1) - 1}
    engine_cores = {pid: os.sched_getaffinity(pid) for pid in _vllm_processes()}
    assert len(engine_cores) == 2 and all(cores == bound for cores in engine_cores.values()), engine_cores
    own = os.sched_getaffinity(0)
    assert own > bound
    assert all(os.sched_getaffinity(thread.id) == own for thread in psutil.Process().threads())


async def test_greedy_output_is_deterministic_across_calls_and_batches(engine: VllmEngine) -> None:
    prompts = [_prompt(100 + i, length) for i, length in enumerate((5, 64, 130, 300))]
    first = [await _run(engine, f"det-a{i}", prompt) for i, prompt in enumerate(prompts)]
    batched = await asyncio.gather(*(_run(engine, f"det-b{i}", prompt) for i, prompt in enumerate(prompts)))
    for prompt, (tokens, final), (again, _) in zip(prompts, first, batched, strict=True):
        assert len(tokens) == GREEDY.max_tokens
        assert again == tokens
        assert final.finish_reason == "length"
        assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), GREEDY.max_tokens)
    assert len({tuple(tokens) for tokens, _ in first}) == len(prompts)  # the prompt matters


async def test_repeated_prompt_hits_the_prefix_cache(engine: VllmEngine) -> None:
    prompt = _prompt(200, 300)
    before = engine.load()
    tokens, first = await _run(engine, "cache-1", prompt)
    again, second = await _run(engine, "cache-2", prompt)
    assert first.cached_tokens == 0
    assert second.cached_tokens >= BLOCK and second.cached_tokens == (len(prompt) // BLOCK) * BLOCK
    assert again == tokens
    await wait_for(lambda: engine.load().cached_tokens_total == before.cached_tokens_total + second.cached_tokens,
                   DEADLINE_S, "the cache hit in the load counters")
    after = engine.load()
    assert after.prompt_tokens_total == before.prompt_tokens_total + 2 * len(prompt)
    assert after.generated_tokens_total == before.generated_tokens_total + 2 * GREEDY.max_tokens


async def test_kv_events_carry_tokens_that_rebuild_tandems_chain(engine: VllmEngine, event_log: _EventLog) -> None:
    prompt = _prompt(300, 2 * BLOCK + 40)
    await _run(engine, "events-1", prompt)
    expected = set(block_hash_chain(prompt, BLOCK))
    assert len(expected) == 2
    await wait_for(lambda: expected <= _tandem_chains(event_log.drain(engine)), DEADLINE_S, "the prompt's KV events")
    # The snapshot re-announces the same blocks.
    assert expected <= _tandem_chains([AllBlocksCleared(), *engine.kv_snapshot()])
    assert engine.kv_event_bridge.counters.unrecoverable_gaps == 0


async def test_closing_the_stream_aborts_and_frees_blocks(engine: VllmEngine) -> None:
    await wait_for(lambda: engine.load().running == 0, DEADLINE_S, "no request running")
    baseline = engine.load().kv_used_blocks
    long_run = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    stream = engine.generate("abort-1", _prompt(400, 200), long_run)
    received = 0
    async for output in stream:
        received += len(output.token_ids)
        if received >= 5:
            break
    assert engine.load().kv_used_blocks > baseline
    await stream.aclose()
    await wait_for(lambda: engine.load().running == 0 and engine.load().kv_used_blocks == baseline, DEADLINE_S,
                   "the aborted request's blocks freed")


async def test_abort_ends_the_stream_with_an_abort_output(engine: VllmEngine) -> None:
    long_run = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    outputs: list[EngineOutput] = []

    async def consume() -> None:
        async for output in engine.generate("abort-2", _prompt(500, 100), long_run):
            outputs.append(output)

    consumer = asyncio.create_task(consume())
    await wait_for(lambda: sum(len(output.token_ids) for output in outputs) >= 3, DEADLINE_S, "three tokens")
    await engine.abort("abort-2")
    await asyncio.wait_for(consumer, 10)
    final = outputs[-1]
    assert final.finish_reason == "abort" and final.prompt_tokens == 100
    assert final.completion_tokens == sum(len(output.token_ids) for output in outputs) < 600
    await wait_for(lambda: engine.load().running == 0 and engine.load().kv_used_blocks == 0, DEADLINE_S,
                   "the aborted request's blocks freed")


async def test_load_numbers_are_consistent(engine: VllmEngine) -> None:
    long_run = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    stream = engine.generate("load-1", _prompt(600, 150), long_run)
    first = await anext(stream)
    assert first.token_ids
    busy = engine.load()
    assert busy.running == 1 and busy.waiting == 0
    assert 0 < busy.kv_used_blocks <= busy.kv_total_blocks == engine.info.kv_blocks
    assert busy.pending_prefill_tokens == 0
    async for _ in stream:
        pass
    await wait_for(lambda: engine.load().running == 0, DEADLINE_S, "the request to end")
    idle = engine.load()
    assert idle.kv_used_blocks == 0 and idle.pending_prefill_tokens == 0
    assert idle.kv_cached_blocks == engine.kv_event_bridge.cached_blocks > 0
    assert idle.cached_tokens_total <= idle.prompt_tokens_total
    assert idle.generated_tokens_total >= 200


async def test_invalid_requests_are_refused_before_queueing(engine: VllmEngine) -> None:
    with pytest.raises(InvalidArgument):
        engine.generate("bad-1", [], GREEDY)
    with pytest.raises(InvalidArgument):
        engine.generate("bad-2", [5000], GREEDY)
    with pytest.raises(InvalidArgument):
        engine.generate("bad-3", [5] * 1020, GREEDY)  # 1020 + 12 > max_model_len
    stream = engine.generate("dup", [5, 6, 7], GREEDY)
    await anext(stream)
    with pytest.raises(InvalidArgument):
        engine.generate("dup", [5, 6, 7], GREEDY)
    await stream.aclose()


class _SharedEngine:
    """The module's engine behind the Engine protocol, minus stop(): the fixture owns it."""

    def __init__(self, engine: VllmEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def stop(self) -> None:
        pass


async def test_worker_service_serves_the_vllm_engine(engine: VllmEngine, bus: Bus, bus_config: BusConfig) -> None:
    config = WorkerConfig(worker_id="v1", engine="vllm", bus=bus_config, load_interval_s=0.05,
                          kv_event_interval_s=0.01,
                          membership=MembershipConfig(heartbeat_interval_s=0.1, ttl_s=1.0))
    batches: list[KvEventBatch] = []
    loads: list[LoadSnapshot] = []
    subjects = bus_config.subjects
    for subject, codec, sink in ((subjects.kv_events("v1"), Codec(KvEventBatch), batches),
                                 (subjects.load("v1"), Codec(LoadSnapshot), loads)):
        async def collect(msg, codec=codec, sink=sink) -> None:
            sink.append(codec.decode(msg.data))
        await bus.client.subscribe(subject, cb=collect)
    service = WorkerService(config, _SharedEngine(engine), bus)  # type: ignore[arg-type]
    await service.start()
    try:
        members = await bus.key_value(subjects.members_bucket)
        registration = Codec(WorkerRegistration).decode((await members.get("v1")).value)
        assert registration.block_size == BLOCK and registration.compat_hash == engine.info.compat_hash

        prompt = _prompt(700, BLOCK + 10)
        stream = await open_stream(bus, subjects.generate("v1"),
                                   GenerateRequest(request_id="svc-1", model="tiny", token_ids=prompt,
                                                   sampling=GREEDY))
        try:
            tokens = [token async for frame in stream.frames() for token in frame.token_ids]
        finally:
            await stream.close()
        assert len(tokens) == GREEDY.max_tokens and stream.finished.finish_reason == "length"

        expected = block_hash_chain(prompt, BLOCK)[0]
        await wait_for(lambda: expected in _tandem_chains([e for b in batches for e in b.events]), 10,
                       "the prompt's KV events on the bus")
        assert [batch.seq for batch in batches] == list(range(1, len(batches) + 1))
        await wait_for(lambda: bool(loads) and loads[-1].running == 0 and loads[-1].kv_used_blocks == 0, 10,
                       "an idle load report")
    finally:
        await service.stop()
