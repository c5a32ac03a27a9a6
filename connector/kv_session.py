"""One request's part of a KV hand-off on one worker, from before the engine runs it to its
end, on every exit path (`KvSession`, an async context manager over a `DataPlane`):

    async with KvSession(kv, worker_id, request, sender, block_size=..., num_layers=...) as session:
        outputs = engine.generate(request_id, session.token_ids, session.sampling, on_layer=session.on_layer)
        session.admitted()  # the engine took the request
        ...
        handle = await session.at_final_output(first_token)  # before anything else is awaited
        await sender.finished(..., kv_handle=handle)

- entering: pull what `kv_transfer` names (`DataPlane.prepare`), or wait for a prefill
  worker's push (a receiver, its target announced on the request's stream, the push's
  first token appended to the prompt), or get a push writer with its reader reachable; a
  hold only marks the request;
- `admitted()`: the pulled blocks are in the engine's prefix cache; holding them pinned
  until then could deadlock a full pool, so the pins go (an eviction costs a recompute);
- `at_final_output()`: the hold's lease and the push writer's reused blocks (both before
  any await: the blocks could be evicted), then the push's outcome sent to the reader;
- leaving, however: pins released (idempotent), a push that did not complete aborted and a
  failed outcome sent (the reader must not wait), a hold whose handle never reached the
  caller released.

Leave it after the engine's outputs are closed: an engine still running could write layers
of an aborted push.
"""

from __future__ import annotations

import logging
from types import TracebackType

from opentelemetry import trace

from connector.dataplane import DataPlane, Prepared
from connector.port import LayerHook
from connector.push import PushWriter
from shared.errors import ErrorCode, TandemError
from shared.frame_sender import FrameSender
from shared.schemas import GenerateRequest, KvHandle, PushDone
from shared.schemas.generate import prompt_chain

log = logging.getLogger(__name__)


class KvSession:
    def __init__(self, kv: DataPlane | None, worker_id: str, request: GenerateRequest, sender: FrameSender, *,
                 block_size: int, num_layers: int) -> None:
        self._kv = kv
        self._worker_id = worker_id
        self._request = request
        self._sender = sender
        self._block_size = block_size
        self._num_layers = num_layers
        self.token_ids = request.token_ids  # what the engine computes: a pushed first token appended
        self.sampling = request.sampling
        self.prepared = Prepared()
        self.finish_before_start = False  # the pushed first token is a stop token
        self._hold = False
        self._writer: PushWriter | None = None
        self._handle: KvHandle | None = None

    @property
    def on_layer(self) -> LayerHook | None:
        """The engine's per-layer hook of a push writer (engines with an in-process KV port)."""
        return self._writer.on_layer if self._writer is not None else None

    async def __aenter__(self) -> KvSession:
        params = self._request.kv_transfer
        if params is None:
            return self
        kv = self._kv
        if kv is None:
            if params.source is None and params.push_to is None and not params.await_push and not params.hold_for_decode:
                return self  # only a prefix-pull hint: computing the prefix here is the same answer
            raise TandemError(f"worker {self._worker_id} has no KV data plane", code=ErrorCode.UNAVAILABLE)
        self._hold = params.hold_for_decode
        if params.await_push:
            receiver = await kv.push_receiver(self._request)
            await self._sender.kv_target(receiver.target)
            first_token, self.prepared = await kv.await_push(self._request, receiver)
            self.token_ids = [*self._request.token_ids, first_token]
            self.finish_before_start = first_token in self.sampling.stop_token_ids
        elif params.push_to is not None:
            self._writer = kv.push_writer(self._request, params.push_to)
            if not await kv.ensure_push_peer(params.push_to):
                raise TandemError(f"decode worker {params.push_to.reader_worker_id} is unreachable",
                                  code=ErrorCode.UNAVAILABLE)
        else:
            self.prepared = await kv.prepare(self._request)
        return self

    def admitted(self) -> None:
        if self._kv is not None:
            self._kv.release_pins(self.prepared)

    async def at_final_output(self, first_token: int | None) -> KvHandle | None:
        """The hold's handle for the caller (None without a hold); a push completed."""
        kv = self._kv
        if kv is None:
            return None
        if self._hold:
            self._handle = kv.hold(self._request)
        writer = self._writer
        if writer is not None:
            request = self._request
            writer.send_reused(prompt_chain(request, self._block_size), self._num_layers)
            done = await writer.finish(first_token)
            trace.get_current_span().set_attribute("tandem.kv.push_writes", len(writer.timings))
            await kv.send_push_done(writer.target, done)
            self._writer = None
        return self._handle

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        kv = self._kv
        if kv is None:
            return
        kv.release_pins(self.prepared)
        if self._handle is not None and not self._sender.closed:  # the caller never saw the handle
            kv.release_hold(self._handle)
        writer, self._writer = self._writer, None
        if writer is not None:  # the push did not complete: the reader must not wait
            writer.abort()
            try:
                await kv.send_push_done(writer.target, PushDone(transfer_id=writer.target.transfer_id,
                                                                outcome="failed", checksums=[]))
            except Exception as error:  # NATS gone: the reader's own timeout reports the failure
                log.debug("could not tell %s its push failed: %s", writer.target.reader_worker_id, error)
