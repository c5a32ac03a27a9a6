"""vLLM's `prompt_logprobs` in its answers' shape (a completion choice's `prompt_logprobs`, a
chat answer's). Pure.

One entry per prompt token: None for the first (nothing comes before it), else a map from each
token id (as a string, the actual prompt token first, then the top ones; a token listed twice
once) to `{logprob, rank, decoded_token}`, where `decoded_token` is the token's own decoding,
special tokens included, or, for one that decodes to an incomplete character, what it completes
after the prompt tokens before it (`logprobs.LogprobsRenderer`; the first prompt token not
counted, as vLLM's `LogprobsProcessor` counts them). A chat's log-probabilities
below -9999 (minus infinity) are -9999.0, as vLLM's chat endpoint clamps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.router.openai.logprobs import LOWEST_LOGPROB, LogprobsRenderer, SpecialTokenDecoder
from shared.schemas.generate import TokenLogprobs

PromptLogprobs = list[dict[str, dict[str, Any]] | None]


def prompt_logprobs(positions: Sequence[TokenLogprobs | None], decoder: SpecialTokenDecoder, top: int, *,
                    clamp: bool) -> PromptLogprobs:
    """The prompt's `positions` (from the worker), each with its first `top` most likely tokens."""
    texts = LogprobsRenderer(decoder, top)  # each position's texts after the prompt tokens before it
    rendered: PromptLogprobs = []
    for position in positions:
        if position is None:
            rendered.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {}
        for token_id, logprob, rank, text in list(zip(position.token_ids, position.logprobs, position.ranks,
                                                      texts.texts(position)))[:top + 1]:
            entry.setdefault(str(token_id), {"logprob": max(logprob, LOWEST_LOGPROB) if clamp else logprob,
                                             "rank": rank, "decoded_token": text})
        rendered.append(entry)
    return rendered
