"""Log-probabilities of an answer's tokens in the OpenAI shapes, as vLLM's server spells them. Pure.

Workers send, per generated token, `TokenLogprobs`: the sampled token first, then the most
likely ones (vLLM's order). Here they become text:
- a token's text is its own decoding, special tokens included; one that decodes to an
  incomplete character (ending in U+FFFD) is decoded with up to 4 preceding sampled tokens of
  the answer as context, and gets what it completes, or "" while still incomplete (vLLM's
  `LogprobsProcessor` does the same);
- completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, where a position's
  `top_logprobs` holds its first `n + 1` entries (the sampled token and the top `n`), and
  offsets run from 0 by each token's text length, across a stream's pieces too;
- chat: `{content: [{token, logprob, bytes, top_logprobs: [...]}]}`, a position's
  `top_logprobs` being its first `n` entries, the sampled token first.
Log-probabilities below -9999 (minus infinity) are -9999.0, as OpenAI's API writes them.
With vLLM's `return_tokens_as_token_ids` a token is named `token_id:<id>` instead of by its
text (completions' offsets then run by those names; a chat position's own `bytes` stay its
text's, its top entries' are their names', as vLLM's server spells them).
`LogprobsRenderer` keeps the answer's last sampled tokens across pieces (a streamed answer
renders piece by piece).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from shared.schemas.generate import TokenLogprobs

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 4  # enough for any UTF-8 sequence
LOWEST_LOGPROB = -9999.0


class SpecialTokenDecoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


def _bounded(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def token_id_name(token_id: int) -> str:
    """A token named by its id (`return_tokens_as_token_ids`), as vLLM's server names it."""
    return f"token_id:{token_id}"


class LogprobsRenderer:
    def __init__(self, decoder: SpecialTokenDecoder, top: int, *, as_token_ids: bool = False) -> None:
        self._decoder = decoder
        self._top = top
        self._as_token_ids = as_token_ids
        self._context: list[int] = []  # the answer's last sampled tokens, oldest first
        self._text_offset = 0  # completions: the token texts' length so far

    def completion(self, positions: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for position in positions:
            texts = self._names(position, self._texts(position))
            offsets.append(self._text_offset)
            self._text_offset += len(texts[0])
            tokens.append(texts[0])
            token_logprobs.append(_bounded(position.logprobs[0]))
            top_logprobs.append({text: _bounded(logprob)
                                 for text, logprob in list(zip(texts, position.logprobs))[:self._top + 1]})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def prompt(self, prompt_ids: Sequence[int], positions: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        """The prompt's positions of an echoed completion (the first has no log-probability),
        each token's text in the context of the prompt's tokens before it (not counting the
        first), as vLLM's server renders them; the answer's positions follow (`completion`)."""
        answer_context, self._context = self._context, []
        rendered: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, position in zip(prompt_ids, positions, strict=True):
            if position is None:
                text = token_id_name(token_id) if self._as_token_ids else \
                    self._decoder.decode([token_id], skip_special_tokens=False)
                part = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None],
                        "text_offset": [self._text_offset]}
                self._text_offset += len(text)
            else:
                part = self.completion([position])
            for key, values in part.items():
                rendered[key].extend(values)
        self._context = answer_context
        return rendered

    def chat(self, positions: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        content = []
        for position in positions:
            texts = self._texts(position)
            names = self._names(position, texts)
            top = [{"token": name, "logprob": _bounded(logprob), "bytes": _bytes(name)}
                   for name, logprob in list(zip(names, position.logprobs))[:self._top]]
            content.append({"token": names[0], "logprob": _bounded(position.logprobs[0]), "bytes": _bytes(texts[0]),
                            "top_logprobs": top})
        return content

    def texts(self, position: TokenLogprobs) -> list[str]:
        """Each entry's token text at the next position (`_texts`): vLLM's text for it."""
        return self._texts(position)

    def _names(self, position: TokenLogprobs, texts: list[str]) -> list[str]:
        """How the answer names each entry: its text, or its id (`as_token_ids`)."""
        return [token_id_name(token_id) for token_id in position.token_ids] if self._as_token_ids else texts

    def _texts(self, position: TokenLogprobs) -> list[str]:
        """Each entry's token text, in the context of the tokens sampled before this position."""
        context = self._context[-CONTEXT_TOKENS:]
        texts = [self._text(token_id, context) for token_id in position.token_ids]
        self._context = [*context, position.token_ids[0]]
        return texts

    def _text(self, token_id: int, context: list[int]) -> str:
        text = self._decoder.decode([token_id], skip_special_tokens=False)
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        return self._completed(token_id, context)

    def _completed(self, token_id: int, context: list[int]) -> str:
        """What `token_id` completes after the incomplete characters of the context; "" when
        the character is still incomplete."""
        decode = self._decoder.decode
        for count in range(1, len(context) + 1):
            window = context[-count:]
            text = decode([*window, token_id], skip_special_tokens=False)
            if text.endswith(REPLACEMENT_CHAR):
                continue
            clean_end = len(window)  # context tokens before it that decoded whole
            for index in range(len(window) - 1, -1, -1):
                if decode([window[index]], skip_special_tokens=False).endswith(REPLACEMENT_CHAR):
                    clean_end = index
                else:
                    break
            prefix = decode(window[:clean_end], skip_special_tokens=False) if clean_end else ""
            common = 0  # a normalizing tokenizer may not repeat the prefix exactly
            while common < min(len(prefix), len(text)) and prefix[common] == text[common]:
                common += 1
            return text[common:]
        return ""


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
