"""Incremental detokenization: token ids in, text deltas out. Pure.

Decoding each new token alone is wrong twice over: byte-level tokens may carry part of a
multi-byte character (decoded alone it is U+FFFD), and some decoders change a token's
text depending on what precedes it (SentencePiece drops the leading space of the first
token). So each step decodes a short window that starts a few tokens back and emits only
what the new tokens added; text ending in U+FFFD is held back until the character
completes, or until `flush()` at the end of the request. The window's text before the new
tokens is the previous step's result, so a step costs one decode (two when the window
restarts, every ~20 tokens).

The concatenation of every delta plus `flush()` equals decoding the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # tokens decoded before the new ones, for spacing
WINDOW_TOKENS = 24  # the decoding window's longest span before it restarts


class TokenDecoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


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
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back: the request ended, the character never completes."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decoder.decode(self._ids[:self._read_offset])
        prefix_text = self._prefix_text
        full_text = self._decoder.decode(self._ids)
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
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
