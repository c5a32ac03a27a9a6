"""Seeded text workloads for the serving benchmark: pure, no I/O.

Prompts are plain English words (the packaged corpus's vocabulary), so they work against
any OpenAI-compatible endpoint whatever its tokenizer. Their length is counted with a
`count_tokens` function: the served model's tokenizer when one is at hand, else one token
per word (the server's `usage` then tells the real prompt length).

Prompts never share a prefix by accident: the first `DISTINCT_HEAD_WORDS` words after the
optional shared prefix differ between any two prompts of a workload (warm-up ones included),
so no KV block of one prompt matches another's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

from shared.tiny_model import corpus_texts

DISTINCT_HEAD_WORDS = 8
MAX_MISSES = 64  # words drawn that did not fit, before a prompt is declared full
TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class PromptSpec:
    count: int
    prompt_tokens: int
    shared_prefix_tokens: int = 0  # every prompt opens with the same this many tokens
    seed: int = 0

    def __post_init__(self) -> None:
        if self.count < 0 or self.prompt_tokens < 1:
            raise ValueError("prompts need a count >= 0 and prompt_tokens >= 1")
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens:
            raise ValueError("shared_prefix_tokens must be in [0, prompt_tokens)")


@cache
def word_pool() -> tuple[str, ...]:
    """The corpus's distinct lower-case words, sorted (a fixed order: seeds reproduce prompts)."""
    return tuple(sorted({word for text in corpus_texts() for word in re.findall(r"[a-z]+", text.lower())}))


def one_token_per_word(piece: str) -> int:
    return 1


def build_prompts(spec: PromptSpec, count_tokens: TokenCounter = one_token_per_word,
                  words: tuple[str, ...] | None = None) -> list[str]:
    """`spec.count` prompts of about `spec.prompt_tokens` tokens each.

    `count_tokens` is applied to each word as it appears in the text (with its leading
    space): exact for tokenizers that split on whitespace first, as byte-level BPEs do.
    Prompt i does not depend on `spec.count`, so extra prompts (warm-up) can be appended.
    """
    pool = words or word_pool()
    rng = np.random.default_rng([spec.seed, 11])
    shared = _words_until(rng, pool, spec.shared_prefix_tokens, count_tokens, opening=True)
    shared_tokens = _cost(shared, count_tokens, opening=True)
    heads: set[tuple[str, ...]] = set()
    prompts = []
    for _ in range(spec.count):
        head = _draw(rng, pool, DISTINCT_HEAD_WORDS)
        while head in heads:  # a repeat is astronomically rare; redrawing keeps the guarantee exact
            head = _draw(rng, pool, DISTINCT_HEAD_WORDS)
        heads.add(head)
        used = shared_tokens + _cost(head, count_tokens, opening=not shared)
        rest = _words_until(rng, pool, spec.prompt_tokens - used, count_tokens, opening=False)
        prompts.append(" ".join([*shared, *head, *rest]))
    return prompts


def _draw(rng: np.random.Generator, pool: tuple[str, ...], count: int) -> tuple[str, ...]:
    return tuple(pool[index] for index in rng.integers(len(pool), size=count))


def _cost(words: tuple[str, ...] | list[str], count_tokens: TokenCounter, *, opening: bool) -> int:
    """Tokens of `words` as they appear in the text: the opening word has no leading space."""
    return sum(count_tokens(word if opening and index == 0 else " " + word) for index, word in enumerate(words))


def _words_until(rng: np.random.Generator, pool: tuple[str, ...], tokens: int, count_tokens: TokenCounter,
                 *, opening: bool) -> list[str]:
    """Random words, appended while their tokens stay within `tokens`."""
    chosen: list[str] = []
    used = misses = 0
    while used < tokens and misses < MAX_MISSES:
        word = pool[int(rng.integers(len(pool)))]
        cost = count_tokens(word if opening and not chosen else " " + word)
        if used + cost > tokens:
            misses += 1  # a shorter word may still fit the last few tokens
            continue
        chosen.append(word)
        used += cost
    return chosen


def arrival_offsets(count: int, rate_rps: float, seed: int) -> list[float]:
    """Poisson arrivals: send times (seconds from the start) of `count` requests at `rate_rps`."""
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    gaps = np.random.default_rng([seed, 12]).exponential(1.0 / rate_rps, size=count)
    return [float(offset) for offset in np.cumsum(gaps) - gaps[0]] if count else []
