"""The engine contract every engine implementation (sim, vLLM) fulfils.

The worker service is the only caller. It calls `generate()` once per request and
iterates the outputs; closing the iterator early (client gone) aborts the request and
frees its blocks. `take_kv_events()` drains the KV events buffered since the last call;
the worker publishes them. `load()` is a cheap snapshot, polled periodically.

Expected failures are values or typed errors: a prompt longer than the context raises
`shared.errors.InvalidArgument` before any work is queued.

An engine with a KV data plane also fulfils the data plane's own contract: the sim engine
`connector.port.KvPort` (its pool, pins, received blocks, and an `on_layer` hook on
`generate()` for push mode), the vLLM engine `connector.vllm.engine_port.VllmKvEngine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import msgspec

from connector.port import LayerHook
from shared.compat import KvLayout
from shared.errors import InvalidArgument
from shared.schemas.generate import FinishReason, ImageInput, SamplingParams, TokenLogprobs
from shared.schemas.kv_events import BlockStored, KvEvent


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    engine: str  # its name in the engine registry (services.worker.engines)
    model: str  # served model name
    layout: KvLayout
    kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    vocab_size: int

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def compat_hash(self) -> str:
        return self.layout.compat_hash()


class EngineOutput(msgspec.Struct, kw_only=True):
    token_ids: list[int]  # tokens new since the previous output
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the first output's, when asked
    finish_reason: FinishReason | None = None  # set on the last output only
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineLoad(msgspec.Struct, kw_only=True):
    running: int
    waiting: int
    kv_total_blocks: int
    kv_used_blocks: int
    kv_cached_blocks: int
    prompt_tokens_total: int
    cached_tokens_total: int
    generated_tokens_total: int
    pending_prefill_tokens: int
    # Prefill tokens actually computed (reused or received KV excluded; recomputation after
    # a preemption counts again): what a partial transfer costs shows here.
    computed_prompt_tokens_total: int = 0
    # Prompt tokens the engine itself counts as received over a KV connector (vLLM's
    # prompt-token sources); engines without such a count leave it 0.
    external_prompt_tokens_total: int = 0
    # Cached blocks evicted to make room, and blocks a request then missed that had been
    # evicted here; engines that cannot tell leave them 0.
    kv_evicted_blocks_total: int = 0
    kv_evicted_missed_blocks_total: int = 0


def check_request(token_ids: list[int], sampling: SamplingParams, *, vocab_size: int, max_model_len: int) -> None:
    """The limits every engine applies before queueing anything, so all engines refuse the
    same requests with the same `InvalidArgument` messages."""
    if not token_ids:
        raise InvalidArgument("the prompt is empty")
    if sampling.max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be at least 1, got {sampling.max_tokens}")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise InvalidArgument(f"token ids must lie in [0, {vocab_size})")
    prompt_len = len(token_ids)
    if prompt_len > max_model_len:
        raise InvalidArgument(f"the prompt has {prompt_len} tokens, more than the maximum context "
                              f"length of {max_model_len}")
    if prompt_len + sampling.max_tokens > max_model_len:
        raise InvalidArgument(f"the prompt ({prompt_len} tokens) plus max_tokens ({sampling.max_tokens}) "
                              f"exceeds the maximum context length of {max_model_len}")


class Engine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                 on_layer: LayerHook | None = None, adapter: str = "", cache_salt: str = "",
                 images: Sequence[ImageInput] = ()) -> AsyncIterator[EngineOutput]:
        """The request's outputs; `on_layer` (a push writer's, `KvSession.on_layer`) is called as
        each layer of prompt blocks is final, by engines whose KV a Tandem port reads. `adapter`:
        the model's LoRA adapter to serve it with ("": the base model); an engine that cannot
        serve it raises `InvalidArgument`. `cache_salt`: vLLM's, salting the engine's prefix
        cache (an engine without one raises `InvalidArgument`). `images`: the prompt's, their
        placeholder tokens in `token_ids`; an engine whose model takes none raises
        `InvalidArgument`."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def load_adapter(self, adapter: str) -> None:
        """Make the model's LoRA adapter `adapter` ready ahead of its first request (`tandem ctl
        adapter load`); raises `InvalidArgument` when this engine cannot serve it."""
        ...

    def load(self) -> EngineLoad: ...

    def take_kv_events(self) -> list[KvEvent]: ...

    def kv_snapshot(self) -> list[BlockStored]: ...

    async def wait_failed(self) -> str:
        """Returns, with why, once the engine can no longer serve (its processes died, it
        ran out of memory); never returns while it is healthy or being stopped."""
        ...


class EngineFailed(Exception):
    """The engine died under a running worker: the worker left the cluster and exits non-zero."""


ENGINE_FAILED_EXIT = 3  # `tandem worker`'s exit status when its engine died
