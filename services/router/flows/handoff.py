"""How a disaggregated request's prompt KV moves from its prefill part to its decode part:
one `HandOff` per transfer mode of a `RoutePlan`, read by the flow executor's two-part
stream (`services.router.flows.two_part`), which runs the parts in the order and with the
requests the hand-off names.

- `PullHandOff` (prefill first): the prefill worker gets the prompt with `max_tokens=1`
  and `hold_for_decode` (and the prefix to pull from a holder, if the plan has one): it
  computes the prompt, streams the first token and ends with `Finished(kv_handle=...)`, a
  lease on the prompt's full blocks held for the decode worker (None when the prompt has no
  full block). Unless the request is over (the first token was a stop token, `max_tokens`
  was 1, or the prefill worker ended it otherwise), the decode worker then gets
  `prompt + [first]`, `max_tokens - 1` and the handle as its `source`; it pulls the blocks,
  releases the lease itself, computes only what is missing, and streams the rest. A request
  that samples on its output history (`SamplingParams.depends_on_output_history`) keeps its
  prompt and has the decode worker replay the first token instead (`replayed`), so its
  penalties, seeded stream or grammar see the same history as on one engine.
- `PushHandOff` (decode first): the decode worker gets the prompt with `max_tokens - 1`
  and `await_push`: it allocates blocks for the prompt's KV, answers with a `KvTarget`
  frame, and waits (bounded, on its side) for the writer's `PushDone`, which carries the
  first token. On that target the prefill worker gets the prompt with `max_tokens=1` and
  `push_to`: it writes each layer's blocks into the decode worker's as it computes them,
  streams the first token, and sends `PushDone`. The decode worker commits the blocks that
  verified, recomputes the others, and streams the remaining tokens. There is no lease:
  the blocks are the decode worker's from the start. (Replaying requests always pull: the
  first token must exist before the decode part starts.)
"""

from __future__ import annotations

from typing import Protocol

from services.router.flows.records import GenerationParams
from services.router.kv.view import PrefixSource
from shared.schemas import Finished, GenerateRequest
from shared.schemas.transfer import KvHandle, KvTransferParams, PushTarget


class HandOff(Protocol):
    @property
    def decode_first(self) -> bool:
        """The decode part is sent first and waits for the prompt's KV (`KvTarget` first)."""
        ...

    def prefill_transfer(self, target: PushTarget | None) -> KvTransferParams | None:
        """The prefill part's `kv_transfer`; `target` is the decode worker's, when it went first."""
        ...

    def decode_request(self, params: GenerationParams, first_token_ids: list[int],
                       lease: KvHandle | None) -> GenerateRequest:
        """The decode part's request (decode first: before any token exists)."""
        ...

    def continues_after(self, prefill_done: Finished) -> bool:
        """Whether the decode part still has work after the prefill part's one token."""
        ...


class PullHandOff:
    def __init__(self, prefix: PrefixSource | None, *, hold: bool) -> None:
        self._prefix = prefix  # a worker holding more of the prompt than the prefill worker
        self._hold = hold  # a decode part follows: the prefill worker keeps the blocks for it

    @property
    def decode_first(self) -> bool:
        return False

    def prefill_transfer(self, target: PushTarget | None) -> KvTransferParams | None:
        if self._prefix is not None:
            return self._prefix.as_params(hold_for_decode=self._hold)
        return KvTransferParams(hold_for_decode=True) if self._hold else None

    def decode_request(self, params: GenerationParams, first_token_ids: list[int],
                       lease: KvHandle | None) -> GenerateRequest:
        # Without a handle (no full block in the prompt) the decode worker computes everything.
        transfer = KvTransferParams(source=lease) if lease is not None else None
        appended, sampling = params.sampling.continue_after(first_token_ids)
        return GenerateRequest(request_id=params.request_id, model=params.model,
                               token_ids=[*params.prompt_ids, *appended], sampling=sampling, kv_transfer=transfer,
                               adapter=params.adapter, cache_salt=params.cache_salt, images=list(params.images))

    def continues_after(self, prefill_done: Finished) -> bool:
        return prefill_done.finish_reason == "length"  # not after a stop token or an abort


class PushHandOff:
    @property
    def decode_first(self) -> bool:
        return True

    def prefill_transfer(self, target: PushTarget | None) -> KvTransferParams | None:
        assert target is not None, "a pushing prefill worker needs the decode worker's target"
        return KvTransferParams(push_to=target)

    def decode_request(self, params: GenerationParams, first_token_ids: list[int],
                       lease: KvHandle | None) -> GenerateRequest:
        return GenerateRequest(request_id=params.request_id, model=params.model, token_ids=params.prompt_ids,
                               sampling=params.sampling.continued(1), kv_transfer=KvTransferParams(await_push=True),
                               adapter=params.adapter, cache_salt=params.cache_salt, images=list(params.images))

    def continues_after(self, prefill_done: Finished) -> bool:
        return True  # a stop token as the first token is the decode worker's to see (it ends with "stop")
