"""`SimEngine`: the simulated engine behind the `Engine` and `KvPort` contracts
(services/worker/engine.py).

The worker service calls it exactly like the vLLM engine; the KV connector uses its
`KvPort` methods (delegated to the pure `kv_port.SimKvPort`). Inside, one asyncio task runs
the pure scheduler: `step(now)`, sleep for the step's simulated duration divided by the
speed-up factor, then hand each request its new tokens through its own queue, and yield to
the loop once before the next step (so a consumer can pin what a finished prefill left in
the cache before anything else is allocated). With no work the task waits on an event: an
idle engine uses no CPU.

Push mode: when a request of the step has an `on_layer` hook and the step filled some of
its prompt blocks, the sleep is cut into one slice per layer (the profile's layer
fractions) and after slice `l` each such hook gets `(l, block_ids)`: a writer sends layer
`l` while layer `l + 1` is still being "computed". A hook that raises fails its request.

`generate()` validates eagerly (raising `InvalidArgument` before anything is queued) and
returns an async generator; the request is queued on its first iteration. Closing the
generator before the final output (client gone, task cancelled) aborts the request and
frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import numpy as np

from connector.kv_checksums import Piece
from connector.kv_geometry import KvShape
from connector.port import LayerHook
from services.worker.engine import EngineInfo, EngineLoad, EngineOutput
from services.worker.sim.block_manager import BlockManager
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.kv_port import SimKvPort
from services.worker.sim.profile import TimingProfile, load_profile
from services.worker.sim.scheduler import Scheduler, StepResult
from shared.compat import KvLayout
from shared.config import ConfigError, WorkerConfig
from shared.errors import InvalidArgument, TandemError, Unavailable
from shared.schemas.generate import ImageInput, SamplingParams
from shared.schemas.kv_events import BlockStored, KvEvent

log = logging.getLogger(__name__)

_Delivery = EngineOutput | TandemError  # an error ends the stream by raising it


class SimEngine:
    def __init__(self, config: WorkerConfig, sim: SimEngineConfig = SimEngineConfig(), *, model_name: str,
                 vocab_size: int, profile: TimingProfile | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.profile = profile if profile is not None else load_profile(sim.profile)
        self._layer_fractions = self.profile.layer_fractions(sim.layers)  # raises on a mismatch
        self.speedup = sim.speedup
        self._clock = clock
        try:
            self.kv_pool = KvPool(config.kv_blocks, sim.layers, config.block_size, sim.kv_dim,
                                  num_kv_heads=sim.kv_heads, tensor_parallel=config.tensor_parallel,
                                  pipeline_parallel=config.pipeline_parallel)
        except ValueError as error:
            raise ConfigError(f"the sim's KV cannot take this shape: {error}") from error
        blocks = BlockManager(config.kv_blocks, config.block_size, host_blocks=config.kv_host_blocks)
        self.kv_port = SimKvPort(blocks, self.kv_pool)
        self.scheduler = Scheduler(blocks=blocks, pool=self.kv_pool,
                                   profile=self.profile, vocab_size=vocab_size,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len)
        self._info = EngineInfo(
            engine="sim", model=model_name,
            layout=KvLayout(model=model_name, model_version=config.model_version, dtype="float16",
                            block_size=config.block_size, num_layers=sim.layers,
                            num_kv_heads=sim.kv_heads, head_size=sim.kv_dim // sim.kv_heads,
                            engine="sim", tensor_parallel=config.tensor_parallel,
                            pipeline_parallel=config.pipeline_parallel),
            kv_blocks=config.kv_blocks, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            vocab_size=vocab_size)
        self._streams: dict[str, asyncio.Queue[_Delivery]] = {}
        self._layer_hooks: dict[str, LayerHook] = {}
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

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                 on_layer: LayerHook | None = None, adapter: str = "", cache_salt: str = "",
                 images: Sequence[ImageInput] = ()) -> AsyncGenerator[EngineOutput, None]:
        if self._task is None or self._task.done() or self._stopping:
            raise Unavailable("the sim engine is not running")
        if images:
            raise InvalidArgument("the sim engine serves text only: it takes no images")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        self.scheduler.validate_request(request_id, token_ids, sampling)
        return self._stream(request_id, list(token_ids), sampling, on_layer, adapter, cache_salt)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    async def load_adapter(self, adapter: str) -> None:
        """The sim's adapter is its name (it seeds the request's tokens): nothing to read."""

    async def wait_failed(self) -> str:
        """The simulated engine lives in the worker's process: it never dies on its own."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def load(self) -> EngineLoad:
        return self.scheduler.load()

    def take_kv_events(self) -> list[KvEvent]:
        return self.scheduler.blocks.take_events()

    def kv_snapshot(self) -> list[BlockStored]:
        return self.scheduler.blocks.snapshot()

    # ---- KvPort (see connector/port.py for the rules) ------------------------------

    def kv_shape(self) -> KvShape:
        return self.kv_pool.shape

    def kv_regions(self) -> list[np.ndarray]:
        return self.kv_pool.regions

    def prompt_block_ids(self, request_id: str) -> list[int]:
        return self.scheduler.prompt_block_ids(request_id)

    def pin_prefix(self, block_hashes: list[int]) -> list[int]:
        return self.kv_port.pin_prefix(block_hashes)

    def pin_blocks(self, block_ids: list[int]) -> None:
        self.kv_port.pin_blocks(block_ids)

    def allocate_for_transfer(self, num_blocks: int) -> list[int] | None:
        return self.kv_port.allocate_for_transfer(num_blocks)

    def commit_transferred(self, block_ids: list[int], first_block: int, token_ids: list[int], ok: list[bool], *,
                           adapter: str = "", cache_salt: str = "") -> list[bool]:
        return self.kv_port.commit_transferred(block_ids, first_block, token_ids, ok, adapter=adapter,
                                               cache_salt=cache_salt)

    def unpin(self, block_ids: list[int]) -> None:
        self.kv_port.unpin(block_ids)
        self._wakeup.set()  # freed blocks may let a waiting request in

    def block_checksums(self, block_ids: list[int]) -> list[int]:
        return self.kv_port.block_checksums(block_ids)

    def unit_checksums(self, units: list[list[Piece]]) -> list[int]:
        return self.kv_port.unit_checksums(units)

    # ---- internals -------------------------------------------------------------------------

    async def _stream(self, request_id: str, token_ids: list[int], sampling: SamplingParams,
                      on_layer: LayerHook | None, adapter: str, cache_salt: str) -> AsyncGenerator[EngineOutput, None]:
        # Re-checked here: the engine may have stopped, or the id been taken, since generate().
        if self._stopping:
            raise Unavailable("the sim engine is stopping")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue[_Delivery] = asyncio.Queue()
        self.scheduler.add_request(request_id, token_ids, sampling, adapter=adapter, cache_salt=cache_salt)
        self._streams[request_id] = queue
        if on_layer is not None:
            self._layer_hooks[request_id] = on_layer
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
            self._layer_hooks.pop(request_id, None)
            if not finished:
                self.scheduler.abort(request_id)

    def _abort_now(self, request_id: str) -> None:
        output = self.scheduler.abort(request_id)
        queue = self._streams.get(request_id)
        if output is not None and queue is not None:
            queue.put_nowait(output)

    async def _compute(self, result: StepResult) -> set[str]:
        """Sleep for the step; in push mode one layer at a time, calling the layer hooks after
        each slice. Returns the requests whose hook raised (already failed and aborted)."""
        hooked = [(request_id, hook, result.computed_blocks[request_id])
                  for request_id, hook in self._layer_hooks.items() if request_id in result.computed_blocks]
        duration_s = result.duration_s / self.speedup
        if not hooked:
            await asyncio.sleep(duration_s)
            return set()
        failed: set[str] = set()
        for layer, fraction in enumerate(self._layer_fractions):
            await asyncio.sleep(duration_s * fraction)
            for request_id, hook, block_ids in hooked:
                if request_id in failed or request_id not in self._layer_hooks:  # failed, or its stream closed
                    continue
                try:
                    hook(layer, list(block_ids))
                except Exception as error:
                    log.exception("on_layer hook of request %s failed", request_id)
                    failed.add(request_id)
                    self.scheduler.abort(request_id)
                    queue = self._streams.get(request_id)
                    if queue is not None:
                        queue.put_nowait(TandemError(f"on_layer hook failed: {error!r}"))
        return failed

    async def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.scheduler.has_work:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                result = self.scheduler.step(self._clock())
                if result.prefill_tokens == 0 and result.decode_seqs == 0 and not result.preempted:
                    # Nothing fits in the free blocks (transfers or leases hold them): wait for a
                    # change (unpin, abort, new request) rather than spin.
                    log.info("sim engine waiting for free blocks with %d requests queued",
                             len(self.scheduler.request_ids()))
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                failed = await self._compute(result)
                for request_id, output in result.outputs.items():
                    queue = self._streams.get(request_id)
                    if queue is not None and request_id not in failed:
                        queue.put_nowait(output)
                if result.outputs or failed:
                    await asyncio.sleep(0)  # consumers see this step's outputs before the next step
        except Exception as error:  # a bug: fail every stream rather than leave it hanging
            log.exception("sim engine loop crashed")
            self._stopping = True
            for request_id in self.scheduler.request_ids():
                self.scheduler.abort(request_id)
            for queue in self._streams.values():
                queue.put_nowait(TandemError(f"sim engine failed: {error!r}"))
