"""The prompts the vLLM stack tests send, and their single-engine answers.

`SingleEngine` runs one vLLM worker (role both, its own stack) and asks it directly over
the request plane, so the answers come back as token ids; the tests compare what the P/D
router returns with that, rendered as the router renders text.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from services.router.flows.detokenizer import IncrementalDetokenizer
from shared.bus import Bus
from shared.request_plane import open_stream
from shared.schemas import GenerateRequest, SamplingParams
from shared.subjects import Subjects
from shared.tokenizer import Tokenizer

MAX_TOKENS = 12
# Shorter than one 128-token block, exact multiples, one off, several blocks.
LENGTHS = [1, 5, 60, 127, 128, 129, 200, 255, 256, 257, 383, 384, 385, 511, 512, 513, 640, 700, 768, 900, 1000, 1200]
FAULT_LENGTHS = [300, 420, 512, 600, 700, 768, 850, 900, 1000, 1100, 1200, 1300]
TURN1_TOKENS, TURN1_ANSWER, TURN2_NEW, TURN2_ANSWER = 300, 100, 60, 8


def prompt_of(seed: int, length: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]  # ids 0-2 are <unk>, <s>, </s>


def as_router_text(tokenizer: Tokenizer, prompt: list[int], completion: list[int]) -> str:
    """A completion's text as the router renders it: decoded in the prompt's context."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    return detokenizer.push(completion) + detokenizer.finish()


@dataclass
class Workload:
    vocab_size: int
    prompts: list[list[int]] = field(init=False)
    fault_prompts: list[list[int]] = field(init=False)
    turn1: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.prompts = [prompt_of(1000 + i, n, self.vocab_size) for i, n in enumerate(LENGTHS)]
        self.fault_prompts = [prompt_of(2000 + i, n, self.vocab_size) for i, n in enumerate(FAULT_LENGTHS)]
        self.turn1 = prompt_of(3000, TURN1_TOKENS, self.vocab_size)

    def turn2(self, answer1: list[int]) -> list[int]:
        return self.turn1 + answer1 + prompt_of(3001, TURN2_NEW, self.vocab_size)


class SingleEngine:
    """Greedy answers (token ids) of one vLLM worker, asked over the request plane."""

    def __init__(self, bus: Bus, namespace: str, worker_id: str, model: str) -> None:
        self.bus = bus
        self.subject = Subjects(namespace).generate(worker_id)
        self.model = model
        self.answers: dict[tuple[int, ...], list[int]] = {}
        self.cached_tokens = 0  # of the latest answer

    async def answer(self, prompt: list[int], max_tokens: int, *, adapter: str = "") -> list[int]:
        """`adapter`: served with that LoRA adapter of the model; `cached_tokens` then says
        how much of the prompt the engine found in its prefix cache."""
        request = GenerateRequest(request_id=f"ref-{uuid.uuid4().hex[:8]}", model=self.model, token_ids=prompt,
                                  sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                  adapter=adapter)
        stream = await open_stream(self.bus, self.subject, request)
        try:
            tokens = [token async for frame in stream.frames() for token in frame.token_ids]
        finally:
            await stream.close()
        assert len(tokens) == max_tokens and stream.finished is not None
        self.cached_tokens = stream.finished.cached_tokens
        self.answers[tuple(prompt)] = tokens
        return tokens
