"""`/tokenize` and `/detokenize`: the model's tokenizer and chat template (`served_models`; no model
named: the router's own), no worker involved.

The token ids `/tokenize` answers are the ones the generate endpoints would send a worker
for the same prompt or chat (with `add_special_tokens` at what those endpoints use: true
for a prompt; for a chat, the template's own special tokens, and the tokenizer's BOS when
sent true, never twice). `max_model_len` is the model's context length as `/v1/models`
shows it (`model_cards`). `/detokenize` keeps special tokens in the text, as vLLM's does,
so that a tokenize / detokenize round trip gives the prompt back.
"""

from __future__ import annotations

import asyncio

from services.router.http.chat_images import place_images, read_images
from services.router.http.chat_prompt import chat_prompt
from services.router.http.model_cards import max_model_len
from services.router.http.served_models import ServedModel
from services.router.http.serving import ServingContext
from services.router.openai.errors import BadRequest
from services.router.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from shared.tokenizer import Tokenizer

# Decoding this many tokens takes long enough to be worth a thread hop (as
# `serving.TOKENIZE_IN_THREAD_CHARS` for encoding).
DETOKENIZE_IN_THREAD_TOKENS = 4_096


class TokenizeServing:
    def __init__(self, context: ServingContext) -> None:
        self._context = context

    async def _model(self, requested: str | None) -> ServedModel:
        """The named model; none named: the router's own (`RouterConfig.model_dir`)."""
        context = self._context
        return await context.resolve_model(context.catalog.default.name if requested is None else requested)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        model = await self._model(body.model)
        tokenizer = model.tokenizer
        text = self._chat_prompt(tokenizer, body) if isinstance(body, TokenizeChatRequest) else body.prompt
        token_ids = await self._context.prompt_ids(tokenizer, text, add_special_tokens=body.add_special_tokens,
                                                   chat=isinstance(body, TokenizeChatRequest))
        if isinstance(body, TokenizeChatRequest):  # each image's placeholder tokens, as the chat endpoint sends them
            images = await read_images(body.messages, tokenizer, self._context.image_fetcher)
            token_ids, _ = place_images(token_ids, images, tokenizer)
        return TokenizeResponse(count=len(token_ids), max_model_len=max_model_len(self._context, model.name),
                                tokens=token_ids)

    def _chat_prompt(self, tokenizer: Tokenizer, body: TokenizeChatRequest) -> str:
        """The chat as the chat endpoint renders it (`serving_chat`)."""
        messages = [message.template_message() for message in body.messages]
        tools = [tool.template_tool() for tool in body.tools] if body.tools else None
        return chat_prompt(tokenizer, body, messages, tools)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        tokenizer = (await self._model(body.model)).tokenizer
        out_of_vocabulary = [token for token in body.tokens if token >= tokenizer.vocab_size]
        if out_of_vocabulary:
            raise BadRequest(f"Token id {out_of_vocabulary[0]} is out of vocabulary: token ids lie in "
                             f"[0, {tokenizer.vocab_size})", param="tokens")
        if len(body.tokens) >= DETOKENIZE_IN_THREAD_TOKENS:
            text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
        else:
            text = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
