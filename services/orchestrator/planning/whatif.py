"""The what-if model's contract: how the planner adapter asks "what would this split do?".

The orchestrator imports no other service, so the simulator that answers
(`bench.plan.cluster_sim`, which runs on the sim engine's own timing model) is handed to the
adapter by the composition root as a `WhatIfModel`. A decision can then be checked before it
is carried out: e.g. a switch is only worth it if the predicted figures of the new split meet
the SLOs.
"""

from __future__ import annotations

from typing import Protocol

import msgspec


class SplitPrediction(msgspec.Struct, frozen=True, kw_only=True):
    prefill: int
    decode: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    attainment: float  # share of requests meeting both SLOs


class WhatIfModel(Protocol):
    def predict(self, prefill: int, decode: int) -> SplitPrediction:
        """The figures of `prefill` + `decode` workers under the workload the model was built for."""
        ...
