"""The engine contract every engine implementation (sim, vLLM) fulfils.

The worker service is the only caller. It calls `generate()` once per request and
iterates the outputs; closing the iterator early (client gone) aborts the request and
frees its blocks. `take_kv_events()` drains the KV events buffered since the last call;
the worker publishes them. `load()` is a cheap snapshot, polled periodically.

Expected failures are values or typed errors: a prompt longer than the context raises
`shared.errors.InvalidArgument` before any work is queued.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from shared.compat import KvLayout
from shared.schemas.generate import FinishReason, SamplingParams
from shared.schemas.kv_events import BlockStored, KvEvent


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    engine: str  # "sim" | "vllm"
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


class Engine(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams) -> AsyncIterator[EngineOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def take_kv_events(self) -> list[KvEvent]: ...

    def kv_snapshot(self) -> list[BlockStored]: ...
