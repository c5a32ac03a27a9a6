"""The sim engine's own options (`tandem worker --engine sim`): its timing profile, its speed
and the shape of the model it simulates. Named by the sim's `EngineSpec` (`spec.SIM`), they
are the `sim` part of the worker command's config (`services.worker.config.WorkerCommandConfig`);
its flags keep the `--sim-` prefix."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.config import require
from shared.config_fields import flag


class SimEngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    profile: Annotated[str, flag("Timing profile (sim): a JSON file or a packaged name (default, "
                                 "h100-llama-8b-shape).", name="--sim-profile",
                                 doc="See [sim-profiles.md](sim-profiles.md).")] = ""
    speedup: Annotated[float, flag("Run the sim this many times faster.", name="--sim-speedup")] = 1.0
    layers: int = 4
    kv_dim: Annotated[int, flag("sim: bytes of KV per token and layer / 4 in its pool (split over its KV heads).",
                                name="--sim-kv-dim")] = 64
    kv_heads: Annotated[int, flag("sim: KV heads of its model (--tensor-parallel splits them).",
                                  name="--sim-kv-heads")] = 4

    def validate(self) -> None:
        require(self.speedup > 0, "sim speed-up must be positive")
