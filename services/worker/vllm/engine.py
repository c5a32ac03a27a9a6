"""`VllmEngine`: vLLM's `AsyncLLM`, in-process, behind the `Engine` contract.

`start()` connects the KV-event bridge, then builds the engine in a thread (vLLM's start-up
blocks for ~20 s on CPU: config, EngineCore and model-worker processes, weights, KV
cache) so the worker's event loop keeps running; `AsyncLLM` starts its output handler
lazily on the loop at the first request. `info` is known only after `start()`: the
block count and block size are vLLM's choice.

`generate()` validates eagerly like the sim engine (same `InvalidArgument` messages for the
same limits) and returns an async generator; the vLLM request is added on its first
iteration. Outputs are deltas (`RequestOutputKind.DELTA`, no detokenisation: Tandem
detokenises in the router). Closing the generator early aborts the vLLM request; so does
`abort()`, which ends the stream with a final "abort" output as the sim engine does.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncGenerator

from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from services.worker.engine import EngineInfo, EngineLoad, EngineOutput
from services.worker.vllm.environment import engine_environment
from services.worker.vllm.kv_events import KvEventBridge, KvEventEndpoints
from services.worker.vllm.options import VllmEngineOptions
from services.worker.vllm.stats import EngineStats
from shared.compat import KvLayout
from shared.errors import InvalidArgument, TandemError, Unavailable
from shared.schemas.generate import FinishReason, SamplingParams
from shared.schemas.kv_events import BlockStored, KvEvent

log = logging.getLogger(__name__)

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmEngine:
    def __init__(self, options: VllmEngineOptions) -> None:
        options.validate()
        self.options = options
        self.stats = EngineStats()
        self._llm: AsyncLLM | None = None
        self._info: EngineInfo | None = None
        self._bridge: KvEventBridge | None = None
        self._socket_dir: str | None = None
        self._streams: set[str] = set()
        self._awaiting_first_output: dict[str, int] = {}  # request id -> prompt tokens
        self._stopping = False

    @property
    def info(self) -> EngineInfo:
        assert self._info is not None, "the vLLM engine's info is known after start()"
        return self._info

    @property
    def kv_event_bridge(self) -> KvEventBridge:
        assert self._bridge is not None, "the vLLM engine was not started"
        return self._bridge

    async def start(self) -> None:
        assert self._llm is None, "the engine was already started"
        self._socket_dir = tempfile.mkdtemp(prefix="tandem-vllm-")
        endpoints = KvEventEndpoints.in_directory(self._socket_dir)
        args = self._engine_args(endpoints)
        try:
            self._llm = await asyncio.to_thread(self._build, args)
            self._info = self._read_info(self._llm)
            self._bridge = KvEventBridge(endpoints, block_size=self._info.block_size,
                                         replay_timeout_s=self.options.kv_event_replay_timeout_s)
            # vLLM publishes nothing before the first request, and a batch sent before the
            # subscriber connects is recovered by replay (batches are numbered from 0).
            await self._bridge.start()
        except BaseException:
            await self._close()
            raise
        log.info("vLLM engine up: model %s, %d KV blocks of %d tokens, layout %s",
                 self._info.model, self._info.kv_blocks, self._info.block_size, self._info.compat_hash)

    async def stop(self) -> None:
        """Abort every request (each stream gets a final "abort" output), then shut vLLM down."""
        self._stopping = True
        if self._llm is not None and self._streams:
            await self._llm.abort(list(self._streams))
        await self._close()

    def generate(self, request_id: str, token_ids: list[int],
                 sampling: SamplingParams) -> AsyncGenerator[EngineOutput, None]:
        if self._llm is None or self._stopping or self._llm.errored:
            raise Unavailable("the vLLM engine is not running")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        self._validate(token_ids, sampling)
        return self._stream(request_id, list(token_ids), sampling)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._streams:
            await self._llm.abort(request_id)

    def load(self) -> EngineLoad:
        total = self.info.kv_blocks
        return EngineLoad(
            running=self.stats.running, waiting=self.stats.waiting,
            kv_total_blocks=total, kv_used_blocks=round(self.stats.kv_usage * total),
            kv_cached_blocks=self.kv_event_bridge.cached_blocks,
            prompt_tokens_total=self.stats.prompt_tokens_total,
            cached_tokens_total=self.stats.cached_tokens_total,
            generated_tokens_total=self.stats.generated_tokens_total,
            # An upper bound: prompts not yet past their first token, cache hits included.
            pending_prefill_tokens=sum(self._awaiting_first_output.values()))

    def take_kv_events(self) -> list[KvEvent]:
        return self.kv_event_bridge.take_events()

    def kv_snapshot(self) -> list[BlockStored]:
        return self.kv_event_bridge.snapshot()

    # ---- internals -------------------------------------------------------------------------

    def _engine_args(self, endpoints: KvEventEndpoints) -> AsyncEngineArgs:
        options = self.options
        return AsyncEngineArgs(
            model=options.model_dir, served_model_name=options.model_name, dtype=options.dtype,
            seed=options.seed, max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            kv_cache_memory_bytes=options.kv_cache_bytes, block_size=options.block_size,
            enable_prefix_caching=True, enforce_eager=True,
            # Default loggers off; Tandem's own logger below still turns stats on.
            disable_log_stats=True,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=endpoints.publish,
                replay_endpoint=endpoints.replay, buffer_steps=options.kv_event_buffer_steps, topic=""))

    def _build(self, args: AsyncEngineArgs) -> AsyncLLM:
        with engine_environment(self.options):
            return AsyncLLM.from_engine_args(args, stat_loggers=[self.stats.stat_logger_factory()])

    def _read_info(self, llm: AsyncLLM) -> EngineInfo:
        config = llm.vllm_config
        model = config.model_config
        cache = config.cache_config
        kv_dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
        layout = KvLayout(model=self.options.model_name, model_version=self.options.model_version,
                          dtype=str(kv_dtype).removeprefix("torch."), block_size=cache.block_size,
                          num_layers=model.get_num_layers(config.parallel_config),
                          num_kv_heads=model.get_num_kv_heads(config.parallel_config),
                          head_size=model.get_head_size(), engine="vllm")
        assert cache.num_gpu_blocks, "vLLM reported no KV blocks after start-up"
        return EngineInfo(engine="vllm", model=self.options.model_name, layout=layout,
                          kv_blocks=cache.num_gpu_blocks - 1,  # one block is vLLM's null block
                          max_num_seqs=config.scheduler_config.max_num_seqs,
                          max_model_len=model.max_model_len, vocab_size=model.get_vocab_size())

    def _validate(self, token_ids: list[int], sampling: SamplingParams) -> None:
        """The sim engine's limits, so both engines refuse the same requests the same way."""
        info = self.info
        if not token_ids:
            raise InvalidArgument("the prompt is empty")
        if sampling.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {sampling.max_tokens}")
        if min(token_ids) < 0 or max(token_ids) >= info.vocab_size:
            raise InvalidArgument(f"token ids must lie in [0, {info.vocab_size})")
        prompt_len = len(token_ids)
        if prompt_len > info.max_model_len:
            raise InvalidArgument(f"the prompt has {prompt_len} tokens, more than the maximum context "
                                  f"length of {info.max_model_len}")
        if prompt_len + sampling.max_tokens > info.max_model_len:
            raise InvalidArgument(f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) "
                                  f"exceeds the maximum context length of {info.max_model_len}")

    async def _stream(self, request_id: str, token_ids: list[int],
                      sampling: SamplingParams) -> AsyncGenerator[EngineOutput, None]:
        # Re-checked here: the engine may have stopped, or the id been taken, since generate().
        if self._llm is None or self._stopping:
            raise Unavailable("the vLLM engine is stopping")
        if request_id in self._streams:
            raise InvalidArgument(f"duplicate request id {request_id!r}")
        llm = self._llm
        try:
            (engine_input,) = llm.renderer.render_cmpl([{"prompt_token_ids": token_ids}])
        except VLLMValidationError as error:
            raise InvalidArgument(str(error)) from error
        outputs = llm.generate(engine_input, _sampling_params(sampling), request_id)
        self._streams.add(request_id)
        self._awaiting_first_output[request_id] = len(token_ids)
        finished = False
        completion_tokens = 0
        try:
            async for output in outputs:
                self._awaiting_first_output.pop(request_id, None)
                completion = output.outputs[0]
                new_tokens = list(completion.token_ids)
                completion_tokens += len(new_tokens)
                if not output.finished:
                    if new_tokens:
                        yield EngineOutput(token_ids=new_tokens)
                    continue
                finished = True
                reason = _FINISH_REASONS.get(completion.finish_reason or "")
                if reason is None:
                    raise TandemError(f"vLLM ended request {request_id!r} with "
                                      f"finish reason {completion.finish_reason!r}")
                yield EngineOutput(token_ids=new_tokens, finish_reason=reason,
                                   prompt_tokens=len(token_ids), cached_tokens=output.num_cached_tokens or 0,
                                   completion_tokens=completion_tokens)
        except VLLMValidationError as error:
            finished = True
            raise InvalidArgument(str(error)) from error
        except EngineDeadError as error:
            finished = True
            raise Unavailable(f"the vLLM engine died: {error}") from error
        finally:
            # Reached on normal end, on aclose()/GeneratorExit and on cancellation.
            self._streams.discard(request_id)
            self._awaiting_first_output.pop(request_id, None)
            if not finished:
                # vLLM's own generator aborts the request when closed before its end.
                await outputs.aclose()

    async def _close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            # Joins the EngineCore and model-worker processes (seconds): off the loop.
            await asyncio.to_thread(llm.shutdown)
        if self._bridge is not None:
            await self._bridge.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None


def _sampling_params(sampling: SamplingParams) -> VllmSamplingParams:
    return VllmSamplingParams(
        max_tokens=sampling.max_tokens, temperature=sampling.temperature, seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA, detokenize=False)
