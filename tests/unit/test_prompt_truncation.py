"""vLLM's `truncate_prompt_tokens` and `truncation_side` (`services.router.openai.truncation`),
against what vLLM 0.32's `TokenizeParams` and its tokenizer do: -1, the limit, the sides,
and a BOS its tokenizer added."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.router.openai.errors import BadRequest
from services.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.router.openai.truncation import truncated, truncation_length

BOS = 1
PROMPT = [BOS, 10, 11, 12, 13, 14, 15]


def test_a_length_keeps_the_last_tokens_unless_the_right_side_is_named() -> None:
    assert truncated(PROMPT[1:], 3, None) == [13, 14, 15]
    assert truncated(PROMPT[1:], 3, "left") == [13, 14, 15]
    assert truncated(PROMPT[1:], 3, "right") == [10, 11, 12]


def test_a_bos_the_tokenizer_added_stays_where_no_side_is_named() -> None:
    # vLLM's tokenizer truncates the text's tokens to leave room for the BOS it then adds
    assert truncated(PROMPT, 3, None, added_bos=True) == [BOS, 14, 15]
    assert truncated(PROMPT, 1, None, added_bos=True) == [BOS]
    # a named side cuts the whole sequence, BOS too (vLLM slices after tokenizing)
    assert truncated(PROMPT, 3, "left", added_bos=True) == [13, 14, 15]
    assert truncated(PROMPT, 3, "right", added_bos=True) == [BOS, 10, 11]


def test_a_prompt_within_the_length_is_left_whole_and_zero_leaves_nothing() -> None:
    assert truncated(PROMPT, 7, None, added_bos=True) == PROMPT
    assert truncated(PROMPT, 50, "right") == PROMPT
    assert truncated(PROMPT, 0, None, added_bos=True) == []


def test_minus_one_is_the_context_less_one_where_output_is_asked() -> None:
    assert truncation_length(-1, 2048, asks_output=True) == 2047
    assert truncation_length(-1, 2048, asks_output=False) == 2048
    assert truncation_length(2048, 2048, asks_output=True) == 2048
    assert truncation_length(5, 2048, asks_output=True) == 5


def test_more_than_the_context_is_a_400_naming_the_field() -> None:
    with pytest.raises(BadRequest) as refused:
        truncation_length(2049, 2048, asks_output=True)
    assert refused.value.param == "truncate_prompt_tokens"
    assert "cannot be greater than max_model_len = 2048" in str(refused.value)


@given(st.lists(st.integers(0, 99), max_size=40), st.integers(0, 50), st.sampled_from([None, "left", "right"]),
       st.booleans())
def test_the_result_is_never_longer_than_asked_and_is_a_piece_of_the_prompt(
        tokens: list[int], keep: int, side, added_bos: bool) -> None:
    prompt = [BOS, *tokens] if added_bos else tokens
    kept = truncated(prompt, keep, side, added_bos=added_bos)
    assert len(kept) == min(keep, len(prompt))
    if added_bos and side is None and 0 < keep < len(prompt):
        assert kept[0] == BOS and kept[1:] == prompt[len(prompt) - keep + 1:]
    elif keep < len(prompt):
        assert kept == (prompt[len(prompt) - keep:] if side != "right" else prompt[:keep])


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_request_models_take_the_fields_as_vllm_bounds_them(model) -> None:
    base = {"model": "m", "prompt": "hi"} if model is CompletionRequest else \
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request = model.model_validate({**base, "truncate_prompt_tokens": -1, "truncation_side": "right"})
    assert (request.truncate_prompt_tokens, request.truncation_side) == (-1, "right")
    for bad in ({"truncate_prompt_tokens": -2}, {"truncation_side": "middle"}):
        with pytest.raises(ValueError):
            model.model_validate({**base, **bad})
