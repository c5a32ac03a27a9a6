"""Request plane: a generate request and the frames streamed back to the caller.

The worker answers on the request's reply inbox with frames numbered by `seq` from 0:
`Accepted` first, then `Tokens`... (a push-mode decode worker sends one `KvTarget`
before them), and exactly one terminal frame, `Finished` or
`Failed`. A caller that sees a gap in `seq`, or hears nothing for its idle timeout,
ends the request with an explicit error (see `shared.request_plane`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from shared.block_hash import request_chain
from shared.schemas.common import Message
from shared.schemas.transfer import KvHandle, KvTransferParams, PushTarget

FinishReason = Literal["stop", "length", "abort", "cache_threshold"]


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True):
    """Log-probabilities at one position of an answer: the sampled token first, then the most
    likely ones (vLLM's order; the sampled one may appear again among them), with ranks."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class StructuredOutput(msgspec.Struct, kw_only=True, frozen=True):
    """The output's form, enforced by vLLM's structured-output backend: exactly one of a JSON
    schema (its JSON text), any JSON object, a regular expression, one of some strings, or a
    grammar (EBNF/Lark text)."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """How a request samples, as vLLM's `SamplingParams` means each field (the router has
    validated ranges). Defaults change nothing: an engine that cannot model a field refuses
    a request that sets it (`modelled_fields`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    bad_words: list[str] = []
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None  # per generated token, its log-probabilities and this many top ones
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none)
    structured: StructuredOutput | None = None
    # The answer's tokens another engine already made and sent: this engine makes them again
    # first (forced, one step each) so that what samples on the output history (penalties,
    # bad words, a seeded stream, a grammar) has the same history; they are not sent again.
    replayed: list[int] = []

    def non_default_fields(self) -> list[str]:
        """The fields set away from their defaults (`max_tokens` and `temperature` always count)."""
        return [name for name in self.__struct_fields__
                if name in ("max_tokens", "temperature") or getattr(self, name) != _DEFAULTS[name]]

    @property
    def depends_on_output_history(self) -> bool:
        """Whether the next token depends on which earlier tokens were *generated* rather than
        given: penalties on output counts, multi-token bad words, a seeded random stream, and
        structured output (the grammar's state follows the answer). An engine continuing
        such a request replays the tokens already made (`continue_after`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.bad_words
                    or (self.seed is not None and self.temperature > 0) or self.structured is not None)

    @property
    def needs_whole_prompt(self) -> bool:
        """Prompt log-probabilities: only an engine that computes the whole prompt has them, so
        one engine serves the request whole."""
        return self.prompt_logprobs is not None

    def continue_after(self, generated: list[int]) -> tuple[list[int], "SamplingParams"]:
        """How another engine continues after `generated` tokens came from elsewhere (a P/D
        hand-off, a resume): the tokens to append to its prompt, and its parameters. Sampling
        on the output history replays them (the prompt stays); otherwise they join the prompt,
        with fewer tokens to make and fewer before a stop may end it."""
        if self.depends_on_output_history:
            return [], msgspec.structs.replace(self, replayed=[*generated])
        return [*generated], self.continued(len(generated))

    def continued(self, generated: int) -> "SamplingParams":
        """The parameters for the rest of a request after `generated` tokens that join its
        prompt: fewer tokens to make, and fewer before a stop may end it."""
        return msgspec.structs.replace(self, max_tokens=self.max_tokens - generated,
                                       min_tokens=max(0, self.min_tokens - generated))

    def first_token_only(self) -> "SamplingParams":
        """The parameters of a prefill part: one token, sampled as the whole request's first."""
        return msgspec.structs.replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))


_DEFAULTS = {name: getattr(SamplingParams(), name) for name in SamplingParams.__struct_fields__}


class ImageInput(msgspec.Struct, kw_only=True, frozen=True):
    """One image of a prompt: its file's bytes (PNG, JPEG, ...; every worker of the request
    gets them, a decode worker too, for blocks it may have to recompute), its identifier (a
    digest of the bytes: the identity of its KV, `shared.block_hash.image_block_salts`), and
    its placeholder tokens' place in the request's `token_ids` (the router expanded them as
    the engine does)."""

    identifier: str
    start: int
    length: int
    data: bytes = b""

    @property
    def span(self) -> tuple[str, int, int]:
        return self.identifier, self.start, self.length


def image_spans(images: "list[ImageInput] | tuple[ImageInput, ...]") -> list[tuple[str, int, int]]:
    """The `(identifier, start, length)` of each image, as `shared.block_hash.request_chain` takes them."""
    return [image.span for image in images]


class GenerateRequest(Message, tag="generate", kw_only=True):
    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    kv_transfer: KvTransferParams | None = None
    # The LoRA adapter of `model` to serve it with ("": the base model). Its KV is the adapter's
    # own: the request's block-hash chain starts from `shared.block_hash.adapter_root(adapter)`.
    adapter: str = ""
    # vLLM's cache salt ("": none): the chain starts from `shared.block_hash.chain_root(adapter,
    # cache_salt)`, and a vLLM engine salts its own prefix cache with it
    cache_salt: str = ""
    # The prompt's images, in order (a vision-language model's); each one's placeholder tokens
    # are in `token_ids` and its identifier in the hashes of the blocks they are in.
    images: list[ImageInput] = []
    # W3C trace context travels in NATS headers, not here.


def prompt_chain(request: GenerateRequest, block_size: int) -> list[int]:
    """The hash chain of the request's full prompt blocks (`shared.block_hash.request_chain`): from
    its adapter's and cache salt's root, each block salted by the images in it. What a holder
    leases and a push writer reuses."""
    return request_chain(request.token_ids, block_size, adapter=request.adapter, cache_salt=request.cache_salt,
                         images=image_spans(request.images))


# How long a worker may hold a request's `Accepted` for the next frame to travel with it
# (`shared.frame_sender.FrameSender`); a caller's accept timeout must be longer.
ACCEPT_HOLD_S = 0.02


class Accepted(Message, tag="accepted", kw_only=True):
    seq: int
    worker_id: str


class Tokens(Message, tag="tokens", kw_only=True):
    seq: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the request asked
    # the request's first frame, when it asked for prompt log-probabilities: one per prompt token
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Finished(Message, tag="finished", kw_only=True):
    seq: int
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    kv_handle: KvHandle | None = None  # prefill with `hold_for_decode`: the leased blocks
    pulled_tokens: int = 0  # prompt tokens whose KV arrived from another worker
    recomputed_tokens: int = 0  # tokens meant to arrive that had to be computed


class KvTarget(Message, tag="kv_target", kw_only=True):
    """Decode worker with `await_push`: the blocks it allocated for the writer."""

    seq: int
    target: PushTarget


class Failed(Message, tag="failed", kw_only=True):
    seq: int
    code: str
    message: str


ResponseFrame = Accepted | Tokens | KvTarget | Finished | Failed
