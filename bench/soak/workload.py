"""The soak run's mixed workload: pure, seeded, no I/O.

Each request draws, independently: the API (completions or chat), streaming or not, a
prompt (a shared system prefix plus a question, or distinct words), a length (log-uniform
between a few words and several hundred), `max_tokens`, and whether the client gives up
early: a streaming client closes the stream after a few chunks, a non-streaming one stops
waiting after a short time. Prompts are plain words of the packaged corpus, so their
token count under the tiny model's tokenizer stays close to the word count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from bench.serve.prompts import word_pool

Api = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class WorkloadMix:
    chat_fraction: float = 0.5
    stream_fraction: float = 0.6
    shared_prefix_fraction: float = 0.5  # requests opening with one of the shared prefixes
    cancel_fraction: float = 0.1  # requests the client gives up on
    shared_prefixes: int = 4
    prefix_words: tuple[int, int] = (64, 320)
    prompt_words: tuple[int, int] = (4, 480)  # log-uniform, the prefix included
    max_tokens: tuple[int, int] = (1, 128)  # log-uniform
    cancel_after_s: tuple[float, float] = (0.01, 0.5)  # non-streaming give-up time, uniform

    def __post_init__(self) -> None:
        for name in ("chat_fraction", "stream_fraction", "shared_prefix_fraction", "cancel_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1]")
        for name in ("prefix_words", "prompt_words", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be a range of positive integers")


@dataclass(frozen=True, slots=True)
class SoakRequest:
    api: Api
    stream: bool
    prompt: str
    max_tokens: int
    shared_prefix: int | None = None  # which shared prefix it opens with
    cancel_after_chunks: int | None = None  # streaming: the client closes after this many text chunks
    cancel_after_s: float | None = None  # non-streaming: the client stops waiting after this long

    @property
    def kind(self) -> str:
        """A label to count requests by: "chat-stream", "completions-whole", ..."""
        return f"{self.api}-{'stream' if self.stream else 'whole'}"

    @property
    def cancels(self) -> bool:
        return self.cancel_after_chunks is not None or self.cancel_after_s is not None


class RequestMaker:
    """Draws the run's requests, one after the other, from a seeded generator."""

    def __init__(self, seed: int, mix: WorkloadMix = WorkloadMix(), words: tuple[str, ...] | None = None) -> None:
        self.mix = mix
        self._words = words or word_pool()
        self._rng = np.random.default_rng([seed, 21])
        self.prefixes = [" ".join(self._draw_words(int(self._rng.integers(mix.prefix_words[0],
                                                                              mix.prefix_words[1] + 1))))
                         for _ in range(mix.shared_prefixes)]
        self._prefix_words = [len(prefix.split()) for prefix in self.prefixes]

    def next(self) -> SoakRequest:
        mix, rng = self.mix, self._rng
        api: Api = "chat" if rng.random() < mix.chat_fraction else "completions"
        stream = bool(rng.random() < mix.stream_fraction)
        words = self._log_uniform(*mix.prompt_words)
        prefix: int | None = None
        if self.prefixes and rng.random() < mix.shared_prefix_fraction:
            prefix = int(rng.integers(len(self.prefixes)))
        head = self.prefixes[prefix].split() if prefix is not None else []
        prompt = " ".join([*head, *self._draw_words(max(1, words - len(head)))])
        max_tokens = self._log_uniform(*mix.max_tokens)
        cancel_chunks: int | None = None
        cancel_s: float | None = None
        if rng.random() < mix.cancel_fraction:
            if stream:
                cancel_chunks = int(rng.integers(1, max(2, max_tokens // 2) + 1))
            else:
                cancel_s = round(float(rng.uniform(*mix.cancel_after_s)), 3)
        return SoakRequest(api=api, stream=stream, prompt=prompt, max_tokens=max_tokens, shared_prefix=prefix,
                           cancel_after_chunks=cancel_chunks, cancel_after_s=cancel_s)

    def _draw_words(self, count: int) -> list[str]:
        return [self._words[index] for index in self._rng.integers(len(self._words), size=count)]

    def _log_uniform(self, low: int, high: int) -> int:
        return int(round(float(np.exp(self._rng.uniform(np.log(low), np.log(high))))))
