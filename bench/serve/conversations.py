"""Seeded multi-turn conversations for the serving benchmark's `multiturn` workload, and
their per-turn figures: pure, no I/O.

A conversation is an opening user message and one more user message per later turn.
Turn 1's prompt is the opening; turn N+1's prompt is turn N's prompt, the answer to it and
the next user message. Prompts travel as token ids, turn N's unchanged at the head of turn
N+1's, so every full KV block of turn N's prompt is a prefix block of turn N+1's; the
answer is the answer's text as the tokenizer splits it (what a client that keeps the
conversation as text sends). Messages are the serving benchmark's seeded random words
(`bench.serve.prompts`): no two conversations share a block.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bench.serve.prompts import PromptSpec, TokenCounter, build_prompts, one_token_per_word
from bench.serve.stats import distribution_ms


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    conversations: int
    turns: int
    opening_tokens: int  # turn 1's prompt
    user_tokens: int  # each later user message
    seed: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 2 or self.opening_tokens < 1 or self.user_tokens < 1:
            raise ValueError("a multi-turn workload needs >= 1 conversation, >= 2 turns and positive message sizes")


@dataclass(frozen=True, slots=True)
class Conversation:
    opening: str
    messages: tuple[str, ...]  # the user messages of turns 2, 3, ...


def build_conversations(spec: ConversationSpec, count_tokens: TokenCounter = one_token_per_word,
                        ) -> list[Conversation]:
    """`spec.conversations` conversations; conversation i does not depend on the count, so
    extra ones (warm-up) can be appended."""
    later = spec.turns - 1
    openings = build_prompts(PromptSpec(count=spec.conversations, prompt_tokens=spec.opening_tokens,
                                        seed=2 * spec.seed), count_tokens)
    messages = build_prompts(PromptSpec(count=spec.conversations * later, prompt_tokens=spec.user_tokens,
                                        seed=2 * spec.seed + 1), count_tokens)
    return [Conversation(opening=opening, messages=tuple(messages[index * later:(index + 1) * later]))
            for index, opening in enumerate(openings)]


def next_prompt(prompt_ids: list[int], answer_ids: list[int], message_ids: list[int]) -> list[int]:
    """Turn N+1's prompt: turn N's, its answer, the next user message."""
    return [*prompt_ids, *answer_ids, *message_ids]


@dataclass(frozen=True, slots=True)
class TurnResult:
    conversation: int
    turn: int  # 1-based
    prompt_tokens: int
    answer_tokens: int  # the answer as re-tokenized for the next turn
    ttft_s: float | None
    error: str | None = None
    answer: str = ""  # its text, to compare runs

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


def turn_figures(results: Iterable[TurnResult]) -> dict:
    """TTFT of turn 1 and of turns 2+ (ms), errors, and the conversations' sizes."""
    results = list(results)
    done = [result for result in results if result.ok]
    later = [result for result in done if result.turn > 1]
    last = {}
    for result in done:
        if result.turn >= last.get(result.conversation, (0, 0))[0]:
            last[result.conversation] = (result.turn, result.prompt_tokens + result.answer_tokens)
    sizes = [size for _, size in last.values()]
    return {
        "requests": len(results), "errors": len(results) - len(done),
        "ttft_turn1_ms": distribution_ms([result.ttft_s for result in done if result.turn == 1]),
        "ttft_turn2plus_ms": distribution_ms([result.ttft_s for result in later]),
        "mean_prompt_tokens_turn2plus": round(sum(r.prompt_tokens for r in later) / len(later), 1) if later else None,
        "conversation_tokens": {"min": min(sizes), "max": max(sizes)} if sizes else None,
    }
