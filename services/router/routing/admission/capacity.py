"""How many requests of a model the router lets run at once. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterable

from services.router.routing.eligibility import can_serve
from services.router.routing.view import WorkerView


def admission_capacity(workers: Iterable[WorkerView], model: str, slots_per_seq: float) -> int:
    """`slots_per_seq` x the batch size (max_num_seqs) of the workers that finish `model`'s
    requests (decode or both); 0 when none serves it (the dispatcher then waits for one)."""
    seqs = sum(worker.max_num_seqs for worker in workers if can_serve(worker, model))
    return math.floor(seqs * slots_per_seq) if seqs else 0
