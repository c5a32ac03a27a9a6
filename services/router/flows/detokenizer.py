"""Incremental detokenization: token ids in, text deltas out. Pure.

Decoding each new token alone is wrong twice over: byte-level tokens may carry part of a
multi-byte character (decoded alone it is U+FFFD), and some decoders change a token's
text depending on what precedes it (SentencePiece drops the leading space of the first
token). So each step decodes a short window that starts a few tokens back and emits only
what the new tokens added; text ending in U+FFFD is held back until the character
completes, or until `flush()` at the end of the request. The window's text before the new
tokens is the previous step's result, so a step costs one decode (two when the window
restarts, every ~20 tokens).

The concatenation of every delta equals decoding the whole output, less a character that
never completed at its end: that is dropped when the request ends, as vLLM's own
detokenizer drops it (`finish()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # tokens decoded before the new ones, for spacing
WINDOW_TOKENS = 24  # the decoding window's longest span before it restarts


class TokenDecoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def answer_text(decoder: TokenDecoder, token_ids: Sequence[int]) -> str:
    """The text an answer of exactly `token_ids` shows: all of it, less a character that never
    completed at its end (what `IncrementalDetokenizer` emits in total, however the tokens came)."""
    ids = list(token_ids)
    while ids:
        text = decoder.decode(ids)
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        ids.pop()
    return ""


class SpecialTokenDecoder(Protocol):
    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str: ...


class SpecialTokensKept:
    """A decoder that writes special tokens' text too (`skip_special_tokens: false`)."""

    def __init__(self, decoder: SpecialTokenDecoder) -> None:
        self._decoder = decoder

    def decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=False)


class IncrementalDetokenizer:
    def __init__(self, decoder: TokenDecoder, prompt_ids: Sequence[int] = ()) -> None:
        self._decoder = decoder
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._ids = context
        self._read_offset = len(context)  # ids before this are already emitted
        self._prefix_text: str | None = None  # the text of ids[:read_offset], once decoded

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` add, minus any incomplete trailing character."""
        self._ids.extend(token_ids)
        return self._advance()

    def finish(self) -> str:
        """The request ended: of the text still held back, what the tokens before the last
        incomplete character add (decoded token by token, as vLLM's detokenizer emits); the
        character that never completed is dropped, as vLLM's server drops it."""
        held = self._ids[self._read_offset:]
        for count in range(len(held) - 1, 0, -1):
            self._ids = self._ids[:self._read_offset + count]
            text = self._advance()
            if text:
                return text
        return ""

    def _advance(self) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decoder.decode(self._ids[:self._read_offset])
        prefix_text = self._prefix_text
        full_text = self._decoder.decode(self._ids)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        # The window grows by what was just emitted (its text is the next step's prefix, no
        # second decode); past WINDOW_TOKENS it restarts a few tokens back.
        self._read_offset = len(self._ids)
        if self._read_offset > WINDOW_TOKENS:
            del self._ids[:self._read_offset - PROMPT_CONTEXT_TOKENS]
            self._read_offset = len(self._ids)
            self._prefix_text = None
        else:
            self._prefix_text = full_text
        return delta
