"""Dynamo's answers as token ids, for a client that must carry them into a next turn.

`stream_answer`: one streamed `/v1/completions` with a token-id prompt, exactly as
`client.stream_completion` sends it (TTFT at the first non-empty text chunk, errors as short
reasons), that also returns the answer's token ids: Dynamo sends them per chunk when asked
with `"nvext": {"extra_fields": ["completion_token_ids"]}`. The mocker's answers are random
ids, so a conversation's next turn carries these, not `workloads.answer_tokens` (the mocker
caches no answer blocks anyway: a next turn hits its previous prompt's blocks only). The
sweep drives Dynamo through `sweep_drive` like any system; this is for probes by hand and
the Dynamo stack's tests.
"""

from __future__ import annotations

import httpx

from bench.routing.client import stream_completion
from bench.routing.workloads import Outcome

TOKEN_IDS = {"extra_fields": ["completion_token_ids"]}


async def stream_answer(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                        outcome: Outcome) -> list[int]:
    """Stream one completion into `outcome`; the answer's token ids (complete only when
    `outcome.error` is None)."""
    answer: list[int] = []
    await stream_completion(client, model, prompt, max_tokens, outcome, extra={"nvext": TOKEN_IDS},
                            answer_ids=answer)
    return answer
