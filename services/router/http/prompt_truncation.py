"""A generate request's `truncate_prompt_tokens`, against the model's context length now
(`model_cards.max_model_len`, the limit `/v1/models` shows); the rule is
`services.router.openai.truncation`'s."""

from __future__ import annotations

from services.router.http.model_cards import max_model_len
from services.router.http.serving import ServingContext
from services.router.openai.protocol import SamplingFields
from services.router.openai.truncation import truncated, truncation_length


def truncate_prompt(context: ServingContext, body: SamplingFields, model: str, prompt_ids: list[int], *,
                    added_bos: bool, asks_output: bool) -> list[int]:
    """`prompt_ids` as the request asks them cut (unchanged where it does not)."""
    if body.truncate_prompt_tokens is None:
        return prompt_ids
    keep = truncation_length(body.truncate_prompt_tokens, max_model_len(context, model), asks_output=asks_output)
    return truncated(prompt_ids, keep, body.truncation_side, added_bos=added_bos)
