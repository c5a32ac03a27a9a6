"""`VllmEngine`: vLLM's `AsyncLLM`, in-process, behind the `Engine` contract.

`start()` connects the KV-event bridge, then builds the engine in a thread (vLLM's start-up
blocks for ~20 s on CPU) so the worker's event loop keeps running; `AsyncLLM` starts its
output handler on the loop at the first request. `info` is known only after `start()`.

`generate()` validates eagerly like the sim engine (same `InvalidArgument` messages for the
same limits) and returns an async generator; the vLLM request is added on its first
iteration. Outputs are deltas (`RequestOutputKind.DELTA`, no detokenisation: Tandem
detokenises in the router). Closing the generator early aborts the vLLM request; so does
`abort()`, which ends the stream with a final "abort" output as the sim engine does.

KV transfer (`options.kv_connector`): vLLM loads Tandem's connector
(`connector.vllm.tandem_connector`); `connector.vllm.kv_link.ConnectorLink` is this
process's end of it. The engine implements the data plane's port
(`connector.vllm.engine_port.VllmKvEngine`): the worker's KV data plane
(`connector.vllm.worker_kv.VllmWorkerKv`) stages a `TransferOrder` for a request id with `stage()`;
`generate()` takes it and the stream carries it to vLLM in `kv_transfer_params`:

- a pull: the stream waits (bounded) for the pull's `Loaded` report before yielding its
  first output and hands it to the order's `on_loaded` callback, so the outcome is known
  before any token leaves;
- a hold: the final output names the prompt blocks vLLM pinned; the stream adds their
  checksums and keeps them for `take_held()` until it is closed, then unpins what nobody
  took (and, if the request ended without its final output, unpins in case vLLM pinned);
- a push's writer: the order travels to the connector, which writes the prompt's blocks
  as vLLM computes them (the data plane waits for the outcome);
- a push's reader (`release_key`): the pushed blocks are cached and pinned in vLLM before
  the request is added; the stream unpins them once the request was admitted (its first
  output), or when it ends without one.

A stream's part in these is `stream_transfer.StreamTransfer`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import psutil
import vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from connector.port import LayerHook
from connector.vllm.engine_port import LoadCallback, StagedTransfer
from connector.vllm.kv_link import ConnectorLink, HeldBlocks
from connector.vllm.kv_wire import TransferOrder
from services.worker.engine import EngineInfo, EngineLoad, EngineOutput, check_request
from services.worker.vllm.adapters import LoraCatalog
from services.worker.vllm.attention import attention_isa
from services.worker.vllm.engine_config import engine_args, engine_info
from services.worker.vllm.environment import engine_environment
from services.worker.vllm.image_prompt import check_placement, engine_prompt
from services.worker.vllm.kv_events import KvEventBridge, KvEventEndpoints
from services.worker.vllm.options import VllmEngineOptions
from services.worker.vllm.outputs import OutputReader
from services.worker.vllm.processes import child_pids, engine_processes, reap_processes, wait_engine_failure
from services.worker.vllm.sampling import vllm_sampling_params
from services.worker.vllm.stats import EngineStats
from services.worker.vllm.stream_transfer import StreamTransfer
from shared.config import ConfigError
from shared.errors import InvalidArgument, Unavailable
from shared.schemas.generate import ImageInput, SamplingParams
from shared.schemas.kv_events import BlockStored, KvEvent
from shared.tracing import inject_headers

log = logging.getLogger(__name__)

ENGINE_EXIT_TIMEOUT_S = 20.0  # after vLLM's shutdown, for its processes to be gone


class VllmEngine:
    def __init__(self, options: VllmEngineOptions) -> None:
        options.validate()
        self.options = options
        self.loras = LoraCatalog(options.adapter_dir, options.max_loras)
        self.stats = EngineStats()
        self._llm: AsyncLLM | None = None
        self._info: EngineInfo | None = None
        self._bridge: KvEventBridge | None = None
        self._socket_dir: str | None = None
        self._processes: list[psutil.Process] = []  # vLLM's own processes, started with the engine
        self._streams: set[str] = set()
        self._awaiting_first_output: dict[str, int] = {}  # request id -> prompt tokens
        self._stopping = False
        self._link: ConnectorLink | None = None
        self._staged: dict[str, StagedTransfer] = {}  # request id -> order for its next generate()
        self._held: dict[str, HeldBlocks] = {}  # request id -> blocks its stream holds for take_held()

    @property
    def info(self) -> EngineInfo:
        assert self._info is not None, "the vLLM engine's info is known after start()"
        return self._info

    @property
    def kv_event_bridge(self) -> KvEventBridge:
        assert self._bridge is not None, "the vLLM engine was not started"
        return self._bridge

    @property
    def kv_link(self) -> ConnectorLink:
        assert self._link is not None, "the vLLM engine runs without Tandem's KV connector"
        return self._link

    @property
    def kv_transfer_enabled(self) -> bool:
        return self.options.kv_connector is not None

    async def start(self) -> None:
        assert self._llm is None, "the engine was already started"
        self._socket_dir = tempfile.mkdtemp(prefix="tandem-vllm-")
        endpoints = KvEventEndpoints.in_directory(self._socket_dir)
        try:
            if self.options.kv_connector is not None:
                from connector.nixl_agent import nixl_available

                if not nixl_available():
                    raise ConfigError("Tandem's vLLM KV connector needs NIXL (pip install --no-deps "
                                      "nixl-cu12); run with --no-kv-transfer to compute everything locally")
                self._link = ConnectorLink(self.options.kv_connector, self._socket_dir)
                self._link.bind()
            args = engine_args(self.options, endpoints, self._link)
            before = child_pids()
            try:
                self._llm = await asyncio.to_thread(self._build, args)
            finally:  # vLLM's EngineCore and model worker: what `stop` waits for
                self._processes = engine_processes(before)
            if self._link is not None:
                await self._link.start(self._llm)
            self._info = engine_info(self.options, self._llm.vllm_config)
            self._bridge = KvEventBridge(endpoints, block_size=self._info.block_size,
                                         replay_timeout_s=self.options.kv_event_replay_timeout_s)
            # vLLM publishes nothing before the first request, and a batch sent before the
            # subscriber connects is recovered by replay (batches are numbered from 0).
            await self._bridge.start()
        except BaseException:
            await self._close()
            raise
        log.info("vLLM engine up: model %s, %d KV blocks of %d tokens, layout %s, attention kernel %s",
                 self._info.model, self._info.kv_blocks, self._info.block_size, self._info.compat_hash,
                 attention_isa(self._llm.vllm_config))

    async def stop(self) -> None:
        """Abort every request (each stream gets a final "abort" output), then shut vLLM down."""
        self._stopping = True
        if self._llm is not None and self._streams and not self._llm.errored:  # a dead engine aborts nothing
            await self._llm.abort(list(self._streams))
        await self._close()

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                 on_layer: LayerHook | None = None, adapter: str = "", cache_salt: str = "",
                 images: Sequence[ImageInput] = ()) -> AsyncGenerator[EngineOutput, None]:
        """`on_layer` is not used: vLLM's own connector writes a push, from the order staged
        for the request. `adapter`: served with its `LoRARequest` (`adapters.LoraCatalog`).
        `cache_salt`: vLLM's own (its block hashes take it in). `images`: handed to vLLM's
        processor (`image_prompt`)."""
        if self._llm is None or self._stopping or self._llm.errored:
            raise Unavailable("the vLLM engine is not running")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        lora = self.loras.request(adapter) if adapter else None
        self._validate(token_ids, sampling)
        # The stream owns a staged order from here on (a stream never iterated never reaches
        # vLLM: nothing is pinned for it, and a pull's lease ends by expiry).
        return self._stream(request_id, list(token_ids), sampling, self._staged.pop(request_id, None), lora,
                            tuple(images), cache_salt)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._streams:
            await self._llm.abort(request_id)

    async def load_adapter(self, adapter: str) -> None:
        """vLLM reads the adapter's weights now (else at its first request)."""
        lora = self.loras.request(adapter)
        if self._llm is None or self._stopping or self._llm.errored:
            raise Unavailable("the vLLM engine is not running")
        await self._llm.add_lora(lora)

    async def wait_failed(self) -> str:
        assert self._llm is not None, "the vLLM engine was not started"
        llm = self._llm
        return await wait_engine_failure(self._processes, lambda: "vLLM's engine core died" if llm.errored else None,
                                         lambda: self._stopping)

    def load(self) -> EngineLoad:
        total = self.info.kv_blocks
        return EngineLoad(
            running=self.stats.running, waiting=self.stats.waiting,
            kv_total_blocks=total, kv_used_blocks=round(self.stats.kv_usage * total),
            kv_cached_blocks=self.kv_event_bridge.cached_blocks,
            prompt_tokens_total=self.stats.prompt_tokens_total,
            cached_tokens_total=self.stats.cached_tokens_total,
            generated_tokens_total=self.stats.generated_tokens_total,
            computed_prompt_tokens_total=self.stats.computed_prompt_tokens_total,
            external_prompt_tokens_total=self.stats.external_prompt_tokens_total,
            # An upper bound: prompts not yet past their first token, cache hits included.
            pending_prefill_tokens=sum(self._awaiting_first_output.values()))

    def take_kv_events(self) -> list[KvEvent]:
        return self.kv_event_bridge.take_events()

    # ---- KV transfer (the worker's KV data plane calls these; see the module docstring) ----

    def stage(self, request_id: str, order: TransferOrder, on_loaded: LoadCallback | None = None) -> None:
        """Attach `order` to the next `generate(request_id, ...)`."""
        assert self._link is not None, "KV transfer needs Tandem's connector (options.kv_connector)"
        assert (order.pull is None) == (on_loaded is None), "a pull needs an on_loaded callback"
        self._staged[request_id] = StagedTransfer(order, on_loaded)

    def unstage(self, request_id: str) -> StagedTransfer | None:
        """Take back an order `generate()` never picked up (the request failed before it ran)."""
        return self._staged.pop(request_id, None)

    def take_held(self, request_id: str) -> HeldBlocks | None:
        """The prompt blocks vLLM pinned for a finished hold request; from then on the caller
        owns the pin (`kv_link.unpin_soon([held.key])`). Call it before closing the stream."""
        return self._held.pop(request_id, None)

    def prefix_tokens(self, block_hashes: list[int]) -> list[int]:
        """The tokens of the longest prefix of `block_hashes` the KV events say is cached."""
        return self.kv_event_bridge.mirror.prefix_tokens(block_hashes)

    def prefix_blocks(self, block_hashes: list[int]) -> list[int]:
        """vLLM's own hashes of the same prefix's blocks."""
        return self.kv_event_bridge.mirror.prefix_blocks(block_hashes)

    def kv_snapshot(self) -> list[BlockStored]:
        return self.kv_event_bridge.snapshot()

    # ---- internals -------------------------------------------------------------------------

    def _build(self, args: AsyncEngineArgs) -> AsyncLLM:
        with engine_environment(self.options):
            return AsyncLLM.from_engine_args(args, stat_loggers=[self.stats.stat_logger_factory()])

    def _validate(self, token_ids: list[int], sampling: SamplingParams) -> None:
        """The sim engine's limits, so both engines refuse the same requests the same way."""
        check_request(token_ids, sampling, vocab_size=self.info.vocab_size, max_model_len=self.info.max_model_len)

    def _vllm_request(self, request_id: str, token_ids: list[int], sampling: SamplingParams,
                      staged: StagedTransfer | None, images: Sequence[ImageInput],
                      cache_salt: str) -> tuple[AsyncLLM, Any, vllm.SamplingParams]:
        """The engine, vLLM's input and sampling parameters of a request about to be added."""
        try:
            # Re-checked here: the engine may have stopped, or the id been taken, since generate().
            if self._llm is None or self._stopping:
                raise Unavailable("the vLLM engine is stopping")
            if request_id in self._streams:
                raise InvalidArgument(f"duplicate request id {request_id!r}")
            try:
                image_token_id = getattr(self._llm.model_config.hf_config, "image_token_id", None)
                (engine_input,) = self._llm.renderer.render_cmpl([engine_prompt(token_ids, images, image_token_id,
                                                                                cache_salt)])
                if images:
                    check_placement(engine_input, token_ids)
                return self._llm, engine_input, vllm_sampling_params(sampling, staged.order if staged else None)
            except (VLLMValidationError, ValueError) as error:  # vLLM checks its sampling fields too
                raise InvalidArgument(str(error)) from error
        except BaseException:
            if staged is not None and staged.on_loaded is not None:
                staged.on_loaded(None, "cancelled")  # never reached vLLM
            raise

    async def _stream(self, request_id: str, token_ids: list[int], sampling: SamplingParams,
                      staged: StagedTransfer | None, lora: LoRARequest | None = None,
                      images: Sequence[ImageInput] = (), cache_salt: str = "") -> AsyncGenerator[EngineOutput, None]:
        llm, engine_input, vllm_sampling = self._vllm_request(request_id, token_ids, sampling, staged, images,
                                                              cache_salt)
        transfer = StreamTransfer(self, request_id, staged, self._held) if staged is not None else None
        # vLLM's `llm_request` span joins the trace as a child of the current span (`worker.generate`).
        outputs = llm.generate(engine_input, vllm_sampling, request_id, lora_request=lora,
                               trace_headers=inject_headers() if self.options.otlp_traces_endpoint else None)
        self._streams.add(request_id)
        self._awaiting_first_output[request_id] = len(token_ids)
        finished = False
        reader = OutputReader(request_id, len(token_ids))
        try:
            async for output in outputs:
                self._awaiting_first_output.pop(request_id, None)
                if transfer is not None:
                    await transfer.on_output()
                finished = output.finished
                engine_output = reader.read(output)
                if engine_output is None:
                    continue
                if finished and transfer is not None:
                    await transfer.on_finished(output, engine_output.finish_reason)
                yield engine_output
        except VLLMValidationError as error:
            finished = True
            raise InvalidArgument(str(error)) from error
        except EngineDeadError as error:
            finished = True
            raise Unavailable(f"the vLLM engine died: {error}") from error
        finally:
            # Reached on normal end, on aclose()/GeneratorExit and on cancellation.
            await self._end_stream(request_id, outputs, transfer, finished=finished)

    async def _end_stream(self, request_id: str, outputs: AsyncGenerator[RequestOutput, None],
                          transfer: StreamTransfer | None, *, finished: bool) -> None:
        """Let go of what a request's stream still holds when it ends, however it ends: vLLM's
        request if not finished, then what its KV transfer holds (`StreamTransfer.end`)."""
        self._streams.discard(request_id)
        self._awaiting_first_output.pop(request_id, None)
        if not finished:
            # vLLM's own generator aborts the request when closed before its end.
            await outputs.aclose()
        if transfer is not None:
            transfer.end()

    async def _reap(self) -> None:
        processes, self._processes = self._processes, []
        if processes:
            await reap_processes(processes, ENGINE_EXIT_TIMEOUT_S)

    async def _close(self) -> None:
        if self._link is not None:
            link, self._link = self._link, None
            await link.stop()  # sends the unpins still queued while vLLM still runs
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # AsyncLLM cancels its output task only after the engine is gone, and that task
            # then logs the closing sockets as a dead engine: every stream has ended by now.
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
            # Joins the EngineCore and model-worker processes (seconds): off the loop.
            await asyncio.to_thread(llm.shutdown)
        await self._reap()
        if self._bridge is not None:
            await self._bridge.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
