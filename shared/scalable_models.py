"""Scalable models, as `--scalable-model` declares them (pure): one parser for the router (which
lists them and holds their requests) and the orchestrator (which starts and stops their workers).

`NAME=DIR` is a model that may have zero workers and wakes as one worker of role both.
`NAME=DIR@<P>p<D>d` (e.g. `small=/models/small@1p1d`) wakes disaggregated: P prefill and D
decode workers, started together. A directory may itself contain `@`: only a last `@` followed
by a shape is one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from shared.config import require
from shared.schemas import WorkerRole

_SHAPE = re.compile(r"(?P<prefill>[1-9][0-9]?)p(?P<decode>[1-9][0-9]?)d")
SYNTAX = "NAME=DIR or NAME=DIR@<P>p<D>d (e.g. @1p1d: one prefill and one decode worker)"


@dataclass(frozen=True, slots=True)
class ScalableModel:
    name: str
    directory: str
    prefill_workers: int = 0  # 0 (with decode_workers 0): one worker of role both
    decode_workers: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill_workers > 0

    def roles(self) -> tuple[WorkerRole, ...]:
        """The roles of the workers a wake starts, one entry per worker."""
        if not self.disaggregated:
            return (WorkerRole.BOTH,)
        return (WorkerRole.PREFILL,) * self.prefill_workers + (WorkerRole.DECODE,) * self.decode_workers


def scalable_model(entry: str) -> ScalableModel:
    """One `--scalable-model` entry; raises ConfigError naming it."""
    name, _, spec = entry.partition("=")
    require(bool(name) and bool(spec) and "\n" not in entry, f"scalable model {entry!r} must be {SYNTAX}")
    directory, at, shape = spec.rpartition("@")
    match = _SHAPE.fullmatch(shape) if at else None
    if match is None:
        return ScalableModel(name=name, directory=spec)
    require(bool(directory), f"scalable model {entry!r} names no directory before its shape @{shape}")
    return ScalableModel(name=name, directory=directory, prefill_workers=int(match["prefill"]),
                         decode_workers=int(match["decode"]))


def scalable_models(entries: Iterable[str]) -> dict[str, ScalableModel]:
    """Every entry, by model name; a name given twice is a ConfigError."""
    models: dict[str, ScalableModel] = {}
    for entry in entries:
        model = scalable_model(entry)
        require(model.name not in models, f"scalable model {model.name!r} is given twice")
        models[model.name] = model
    return models
