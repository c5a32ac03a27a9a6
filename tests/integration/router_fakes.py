"""The two parts of the router's integration tests that no real worker can play on cue.

- `GatedSimEngine`: the real sim engine, whose output stream a test can hold at a chosen
  token (a worker that goes silent mid-stream, or takes a request and never answers) or
  break with an error of a chosen code after n tokens (an engine failing mid-request).
  Everything around it (worker service, request plane, leases, KV transfers) is real.
- `ScriptedMember`: a registration with no working worker behind it. `answer=None`: a
  worker that has just died while its entry has not yet expired (nobody listens).
  `"refuse"`: one that refuses every request with `Failed(unavailable)` before accepting
  it while its entry still says active (the moment between a worker starting to drain and
  the router seeing it; a real draining worker re-registers at once, so the router would
  not pick it). `"silent"`: a hung worker that takes requests and never answers, not
  even with `Accepted`.

No tests here; `tests/integration/router_cluster.py` builds workers with these.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from nats.aio.msg import Msg

from connector.port import LayerHook
from services.worker.engine import EngineLoad, EngineOutput
from services.worker.sim.config import SimEngineConfig
from services.worker.sim.engine import SimEngine
from shared.bus import Bus
from shared.codec import encode
from shared.config import WorkerConfig
from shared.errors import ErrorCode, TandemError
from shared.frame_sender import FrameSender
from shared.schemas import SamplingParams, WorkerRegistration
from shared.subjects import Subjects


class GatedSimEngine(SimEngine):
    """`hold_at=k`: after its token number k (0-based) a request's stream waits for
    `release`; a finishing token is sent before the wait and its finish after it, so a
    prefill part's first token reaches the router before its `Finished`. `hold_at=-1`:
    the request is accepted and waits before the engine even starts it.
    `fail=(code, n)`: the stream raises a `TandemError` of that code before token n.
    Its load reports count what a real engine would: a held request as running, one
    waiting before its start as waiting with its prompt's tokens still to compute."""

    def __init__(self, config: WorkerConfig, sim: SimEngineConfig, *, model_name: str, vocab_size: int,
                 hold_at: int | None = None, fail: tuple[str, int] | None = None) -> None:
        super().__init__(config, sim, model_name=model_name, vocab_size=vocab_size)
        self.hold_at = hold_at
        self.fail = fail
        self.release = asyncio.Event()
        self._held = 0
        self._stalled_tokens: list[int] = []

    def load(self) -> EngineLoad:
        load = super().load()
        return msgspec.structs.replace(load, running=load.running + self._held,
                                       waiting=load.waiting + len(self._stalled_tokens),
                                       pending_prefill_tokens=load.pending_prefill_tokens + sum(self._stalled_tokens))

    def generate(self, request_id: str, token_ids: list[int], sampling: SamplingParams, *,
                 on_layer: LayerHook | None = None, adapter: str = "", cache_salt: str = "",
                 images=()) -> AsyncGenerator[EngineOutput, None]:
        return self._gated(super().generate(request_id, token_ids, sampling, on_layer=on_layer, adapter=adapter,
                                            cache_salt=cache_salt, images=images), len(token_ids))

    async def _gated(self, outputs: AsyncGenerator[EngineOutput, None], prompt_tokens: int
                     ) -> AsyncIterator[EngineOutput]:
        delivered = 0
        async with contextlib.aclosing(outputs):
            if self.hold_at is not None and self.hold_at < 0 and not self.release.is_set():
                self._stalled_tokens.append(prompt_tokens)
                try:
                    await self.release.wait()
                finally:
                    self._stalled_tokens.remove(prompt_tokens)
            async for output in outputs:
                if not output.token_ids:
                    yield output
                for index, token in enumerate(output.token_ids):
                    if self.fail is not None and delivered == self.fail[1]:
                        raise TandemError(f"injected engine failure after {delivered} tokens",
                                          code=ErrorCode(self.fail[0]))
                    last = index == len(output.token_ids) - 1
                    holding = self.hold_at == delivered and not self.release.is_set()
                    delivered += 1
                    if last and not holding:
                        yield msgspec.structs.replace(output, token_ids=[token])
                        continue
                    yield EngineOutput(token_ids=[token])
                    if holding:
                        self._held += 1
                        try:
                            await self.release.wait()
                        finally:
                            self._held -= 1
                    if last:
                        yield msgspec.structs.replace(output, token_ids=[])


@dataclass
class ScriptedMember:
    bus: Bus
    subjects: Subjects
    registration: WorkerRegistration
    answer: Literal["refuse", "silent"] | None = None
    _subscriptions: list = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    async def start(self) -> ScriptedMember:
        if self.answer is not None:
            callback = self._refuse if self.answer == "refuse" else self._ignore
            self._subscriptions = [await self.bus.client.subscribe(self.subjects.generate(self.worker_id),
                                                                   cb=callback)]
            await self.bus.client.flush()
        members = await self.bus.key_value(self.subjects.members_bucket)
        await members.put(self.worker_id, encode(self.registration))
        return self

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        members = await self.bus.key_value(self.subjects.members_bucket)
        await members.delete(self.worker_id)

    async def _refuse(self, msg: Msg) -> None:
        await FrameSender(self.bus, msg.reply).failed(ErrorCode.UNAVAILABLE.value,
                                                       f"worker {self.worker_id} is draining")

    async def _ignore(self, msg: Msg) -> None:
        pass
