"""vLLM's `truncate_prompt_tokens` and `truncation_side`, as its server applies them
(`vllm.renderers.params.TokenizeParams`). Pure.

A prompt longer than `truncate_prompt_tokens` keeps that many tokens: its last ones (side
"left", the default of vLLM's generating models) or its first ("right"). -1 asks for the
longest prompt a request may have: the context length, less one where the request asks for
output tokens (a completion always does; a chat when it names `max_tokens` or
`max_completion_tokens`). More than the context length is a 400, as vLLM's server answers it.

Where no side is named and the tokenizer itself added BOS (a completion's text prompt, for
a model whose tokenizer adds one), vLLM's tokenizer truncates the text's own tokens and then
adds BOS, so BOS stays; a named side cuts the whole sequence, BOS included, and so does every
prompt of token ids and every chat (the chat template writes its tokens; none is added).
"""

from __future__ import annotations

from typing import Literal

from services.router.openai.errors import BadRequest

Side = Literal["left", "right"]
DEFAULT_SIDE: Side = "left"  # vLLM's tokenizer for generating models


def truncation_length(requested: int, max_model_len: int, *, asks_output: bool) -> int:
    """How many tokens a prompt keeps at most, for a request's `truncate_prompt_tokens`."""
    if requested > max_model_len:
        raise BadRequest(f"truncate_prompt_tokens={requested} cannot be greater than max_model_len = "
                         f"{max_model_len}. Please request a smaller truncation size.",
                         param="truncate_prompt_tokens")
    if requested < 0:
        return max_model_len - 1 if asks_output else max_model_len
    return requested


def truncated(token_ids: list[int], keep: int, side: Side | None, *, added_bos: bool = False) -> list[int]:
    """`token_ids` cut to `keep` tokens; `added_bos`: their first is a BOS the tokenizer added."""
    if len(token_ids) <= keep:
        return token_ids
    if keep == 0:
        return []
    if added_bos and side is None:
        return token_ids[:1] + truncated(token_ids[1:], keep - 1, DEFAULT_SIDE)
    return token_ids[-keep:] if (side or DEFAULT_SIDE) == "left" else token_ids[:keep]
