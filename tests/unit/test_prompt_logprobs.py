"""vLLM's `prompt_logprobs` in its answers' shape (`services.router.openai.prompt_logprobs`),
and the request rule around them (not streamed; a completion echoed with logprobs computes
them too)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from services.router.openai.prompt_logprobs import prompt_logprobs
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from shared.schemas.generate import TokenLogprobs


class Letters:
    """Token i decodes to the i-th letter; special tokens decode too when asked."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join("abcdefghij"[token] for token in ids)


POSITIONS = [None,
             TokenLogprobs(token_ids=[3, 3, 1], logprobs=[-0.5, -0.5, -1.5], ranks=[1, 1, 2]),
             TokenLogprobs(token_ids=[4, 2, 5], logprobs=[-2.0, -0.1, -float("inf")], ranks=[3, 1, 2])]


def test_each_position_maps_its_tokens_to_logprob_rank_and_text_the_prompt_token_first() -> None:
    rendered = prompt_logprobs(POSITIONS, Letters(), 2, clamp=False)
    assert rendered[0] is None
    assert rendered[1] == {"3": {"logprob": -0.5, "rank": 1, "decoded_token": "d"},
                           "1": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}}  # the prompt token once
    assert list(rendered[2]) == ["4", "2", "5"] and math.isinf(rendered[2]["5"]["logprob"])


def test_top_cuts_each_position_and_a_chat_clamps_minus_infinity() -> None:
    assert prompt_logprobs(POSITIONS, Letters(), 0, clamp=False)[2] == {
        "4": {"logprob": -2.0, "rank": 3, "decoded_token": "e"}}
    assert prompt_logprobs(POSITIONS, Letters(), 2, clamp=True)[2]["5"]["logprob"] == -9999.0


def test_what_the_engine_computes_and_when_it_is_refused() -> None:
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "prompt_logprobs": 3})
    assert completion.prompt_logprobs_top == 3
    echoed = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "echo": True, "logprobs": 2})
    assert echoed.prompt_logprobs_top == 2  # as vLLM's server asks its engine for an echo
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "prompt_logprobs": 0, "stream": True})
    assert chat.prompt_logprobs_top == 0  # 0 streamed is taken (and nothing of it streamed), as on vLLM's server
    with pytest.raises(ValidationError, match="not available when `stream=True`"):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "prompt_logprobs": 1, "stream": True})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "prompt_logprobs": 21})
