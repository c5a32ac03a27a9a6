"""Per-model parts that follow membership (pure): the router keeps one KV namespace
(`kv.view.KvView`) and one placement (`routing.placement.Placements`) per served model, so
that nothing of one model is matched or homed among another model's workers. `ByModel` is
that bookkeeping, once: which model each worker serves, each model's part (made on first
use), a worker that comes back serving another model leaving its old part first, and a part
dropped once its last worker left."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Generic, Protocol, TypeVar


class ModelPart(Protocol):
    @property
    def worker_ids(self) -> Collection[str]: ...

    def worker_left(self, worker_id: str) -> None: ...


PartT = TypeVar("PartT", bound=ModelPart)


class ByModel(Generic[PartT]):
    def __init__(self, make: Callable[[], PartT]) -> None:
        self._make = make
        self.parts: dict[str, PartT] = {}  # model -> its part
        self._model_of: dict[str, str] = {}  # worker id -> its model

    def part(self, model: str) -> PartT:
        """`model`'s part (empty until its workers join)."""
        part = self.parts.get(model)
        if part is None:
            part = self.parts[model] = self._make()
        return part

    def of_worker(self, worker_id: str) -> PartT | None:
        """The part of `worker_id`'s model; None for a worker not (or no longer) a member."""
        model = self._model_of.get(worker_id)
        return None if model is None else self.parts.get(model)

    def join(self, worker_id: str, model: str) -> PartT:
        """`model`'s part, which `worker_id` now belongs to (the caller tells the part). A worker
        that served another model leaves that one first: nothing it had there counts."""
        if self._model_of.get(worker_id, model) != model:
            self.leave(worker_id)
        self._model_of[worker_id] = model
        return self.part(model)

    def leave(self, worker_id: str) -> None:
        """`worker_id` leaves its model's part; a part with no worker left is dropped (it keeps
        no predictions, no homes)."""
        model = self._model_of.pop(worker_id, None)
        part = None if model is None else self.parts.get(model)
        if part is None:
            return
        part.worker_left(worker_id)
        if not part.worker_ids:
            del self.parts[model]
