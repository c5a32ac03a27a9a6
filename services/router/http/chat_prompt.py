"""A chat's prompt text, as the chat endpoint and `/tokenize` both render it: the model's
template over the messages and tools, with the request's `ChatTemplateFields` (a new assistant
turn, or the last message left open; the template's variables)."""

from __future__ import annotations

from typing import Any

from services.router.openai.errors import BadRequest
from services.router.openai.protocol_messages import ChatTemplateFields
from shared.errors import TandemError
from shared.tokenizer import Tokenizer


def chat_prompt(tokenizer: Tokenizer, body: ChatTemplateFields, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> str:
    """The prompt of `messages` (`template_message()`s) by `tokenizer`'s template; a template
    that refuses them is a 400."""
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=body.add_generation_prompt_now,
                                               variables=body.template_variables())
    except TandemError:
        raise
    except Exception as error:  # a template may reject a conversation (e.g. roles out of order)
        raise BadRequest(f"the chat template cannot render these messages: {error}", param="messages") from error
    if body.continue_final_message:
        return open_final_message(prompt, _final_text(messages[-1].get("content")))
    return prompt


def _final_text(content: Any) -> str:
    """The text of the last message that the model continues (of its parts: the last text one)."""
    if isinstance(content, list):
        texts = [part["text"] for part in content if isinstance(part, dict) and "text" in part]
        content = texts[-1] if texts else None
    if not content:
        raise BadRequest("continue_final_message: the final message has no text to continue",
                         param="continue_final_message")
    return content


def open_final_message(prompt: str, final_content: str) -> str:
    """`prompt` cut right after the last message's content, so that the model continues it
    (what Hugging Face's `continue_final_message` does, and vLLM with it)."""
    for content in (final_content, final_content.strip()):  # some templates strip messages
        end = prompt.rfind(content)
        if end >= 0:
            return prompt[:end + len(content)]
    raise BadRequest("continue_final_message: the chat template does not render the final message's content "
                     "as sent", param="continue_final_message")
