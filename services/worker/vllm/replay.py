"""Tokens another engine already made, made again here first (`SamplingParams.replayed`).

A vLLM logits processor, loaded into every vLLM worker's engine: for a request whose
`extra_args` name replayed tokens, each of its first steps may only pick the next of them
(every other logit is -inf). The step still runs everything else vLLM's sampler does for the
request (penalties count the token, a seeded stream draws, a grammar accepts it), so what
follows samples exactly as on the engine that made them. It runs after structured output's
mask; a replayed token was allowed there on the engine that made it, under the same grammar.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

REPLAYED_ARG = "tandem_replayed"
REPLAY_PROCESSOR = f"{__name__}:ReplayLogitsProcessor"  # how the engine arguments name it (a fresh process loads it)


class ReplayLogitsProcessor(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token: greedy requests need it too

    def new_req_logits_processor(self, params: Any) -> Any:
        replayed = (params.extra_args or {}).get(REPLAYED_ARG)
        if not replayed:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            made = len(output_ids)
            if made >= len(replayed):
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[replayed[made]] = 0.0
            return forced

        return force
