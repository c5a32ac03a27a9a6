"""`SimEngine`: the simulated engine behind the `Engine` contract (services/worker/engine.py).

The worker service calls it exactly like the vLLM engine. Inside, one asyncio task runs the
pure scheduler: `step(now)`, sleep for the step's simulated duration divided by the
speed-up factor, then hand each request its new tokens through its own queue. With no work
the task waits on an event: an idle engine uses no CPU.

`generate()` validates eagerly (raising `InvalidArgument` before anything is queued) and
returns an async generator; the request is queued on its first iteration. Closing the
generator before the final output (client gone, task cancelled) aborts the request and
frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable

from services.worker.engine import EngineInfo, EngineLoad, EngineOutput
from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.profile import TimingProfile, load_profile
from services.worker.sim.scheduler import Scheduler
from shared.compat import KvLayout
from shared.config import WorkerConfig
from shared.errors import InvalidArgument, TandemError, Unavailable
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import BlockStored, KvEvent

log = logging.getLogger(__name__)

_Delivery = EngineOutput | TandemError  # an error ends the stream by raising it


class SimEngine:
    def __init__(self, config: WorkerConfig, *, model_name: str, vocab_size: int,
                 profile: TimingProfile | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile if profile is not None else load_profile(config.sim_profile)
        self.profile.layer_fractions(config.sim_layers)  # a layer split must match the layer count
        self.speedup = config.sim_speedup
        self._clock = clock
        self.kv_pool = KvPool(config.kv_blocks, config.sim_layers, config.block_size, config.sim_kv_dim)
        self.scheduler = Scheduler(blocks=BlockManager(config.kv_blocks, config.block_size), pool=self.kv_pool,
                                   profile=self.profile, vocab_size=vocab_size,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len)
        self._info = EngineInfo(
            engine="sim", model=model_name,
            layout=KvLayout(model=model_name, dtype="float16", block_size=config.block_size,
                            num_layers=config.sim_layers, num_kv_heads=1, head_size=config.sim_kv_dim,
                            engine="sim"),
            kv_blocks=config.kv_blocks, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            vocab_size=vocab_size)
        self._streams: dict[str, asyncio.Queue[_Delivery]] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> None:
        assert self._task is None, "the engine was already started"
        self._task = asyncio.create_task(self._run(), name=f"sim-engine:{self._info.model}")

    async def stop(self) -> None:
        """Abort every request (each stream gets a final "abort" output) and end the loop."""
        self._stopping = True
        for request_id in self.scheduler.request_ids():
            self._abort_now(request_id)
        self._wakeup.set()
        if self._task is not None:
            await self._task

    def generate(self, request_id: str, token_ids: list[int],
                 sampling: SamplingParams) -> AsyncGenerator[EngineOutput, None]:
        if self._task is None or self._task.done() or self._stopping:
            raise Unavailable("the sim engine is not running")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        self.scheduler.validate_request(request_id, token_ids, sampling)
        return self._stream(request_id, list(token_ids), sampling)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def load(self) -> EngineLoad:
        return self.scheduler.load()

    def take_kv_events(self) -> list[KvEvent]:
        return self.scheduler.blocks.take_events()

    def kv_snapshot(self) -> list[BlockStored]:
        return self.scheduler.blocks.snapshot()

    # ---- internals -------------------------------------------------------------------------

    async def _stream(self, request_id: str, token_ids: list[int],
                      sampling: SamplingParams) -> AsyncGenerator[EngineOutput, None]:
        # Re-checked here: the engine may have stopped, or the id been taken, since generate().
        if self._stopping:
            raise Unavailable("the sim engine is stopping")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue[_Delivery] = asyncio.Queue()
        self.scheduler.add_request(request_id, token_ids, sampling)
        self._streams[request_id] = queue
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                delivery = await queue.get()
                if isinstance(delivery, TandemError):
                    finished = True
                    raise delivery
                finished = delivery.finished
                yield delivery
        finally:
            # Reached on normal end, on aclose()/GeneratorExit and on cancellation.
            self._streams.pop(request_id, None)
            if not finished:
                self.scheduler.abort(request_id)

    def _abort_now(self, request_id: str) -> None:
        output = self.scheduler.abort(request_id)
        queue = self._streams.get(request_id)
        if output is not None and queue is not None:
            queue.put_nowait(output)

    async def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.scheduler.has_work:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                result = self.scheduler.step(self._clock())
                if result.prefill_tokens == 0 and result.decode_seqs == 0 and not result.preempted:
                    # Nothing could run (should not happen): wait for a change rather than spin.
                    log.warning("sim engine step scheduled nothing with %d requests queued",
                                len(self.scheduler.request_ids()))
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await asyncio.sleep(result.duration_s / self.speedup)
                for request_id, output in result.outputs.items():
                    queue = self._streams.get(request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except Exception as error:  # a bug: fail every stream rather than leave it hanging
            log.exception("sim engine loop crashed")
            self._stopping = True
            for request_id in self.scheduler.request_ids():
                self.scheduler.abort(request_id)
            for queue in self._streams.values():
                queue.put_nowait(TandemError(f"sim engine failed: {error!r}"))
