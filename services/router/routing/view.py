"""What the routing policy knows about one worker at one instant: plain data.

Built by `WorkerPool.views()` (the adapter) from the worker's registration, its last load
snapshot, and this router's own requests on it (its `WorkerLoad` in `ledger`); read by every
stage of routing (eligibility, scoring, the policies).

Load is *predicted* (`ledger.predicted`): the last reported figure corrected by how this
router's own share of it changed since the report arrived. Two figures are predicted that
way: requests (running + waiting), and prompt tokens waiting for prefill (uncached prompt
tokens routed and not yet at their first token). Of the requests, `decoding_load` leaves
out this router's pair prefill parts there (prompts computed for another worker, which
decodes them): the requests whose decode steps a prompt computed there would stall.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.routing.ledger import predicted
from shared.compat import KvLayout
from shared.schemas.membership import WorkerRole, WorkerStatus


@dataclass(slots=True, unsafe_hash=True)
class WorkerView:  # read-only by convention (not frozen: a frozen dataclass is slow to build)
    worker_id: str
    model: str
    role: WorkerRole
    status: WorkerStatus
    max_num_seqs: int
    max_model_len: int
    reported_load: int | None  # running + waiting in the last load snapshot; None before one
    in_flight: int  # this router's requests on the worker now
    in_flight_at_report: int  # ... when that snapshot arrived
    last_routed: int  # this router's routing sequence number of its latest pick (0: never)
    compat_hash: str  # equal hashes can exchange KV blocks
    prefill_parts: int = 0  # of `in_flight`: requests whose prompt only is computed there, for another worker
    reported_prefill_tokens: int | None = None  # pending prefill tokens in the last load snapshot
    outstanding_prefill_tokens: int = 0  # uncached prompt tokens we routed there, not yet at first token
    outstanding_prefill_at_report: int = 0  # ... when that snapshot arrived
    kv_push: bool = False  # its engine receives layer-by-layer pushes (registration capabilities)
    kv_capacity_tokens: int = 0  # its KV pool, in tokens (registration); 0: unknown
    reported_free_kv_tokens: int | None = None  # KV holding nothing reusable, in the last load snapshot
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it holds (registration)
    adapter_slots: int = 0  # how many it can hold at once; 0: it serves no adapter
    block_size: int = 0  # tokens per KV block (0: unknown)
    # what its KV means and how it is cut (registration): why two workers cannot pair
    kv_layout: KvLayout | None = field(default=None, compare=False)

    # Derived once, at construction (every stage reads them, several times per candidate)
    free_kv_tokens: int | None = field(init=False)
    predicted_load: int = field(init=False)
    decoding_load: int = field(init=False)  # of `predicted_load`, those that will decode there
    relative_load: float = field(init=False)
    predicted_prefill_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        # free_kv_tokens: KV it can fill without evicting a cached prefix, predicted like the
        # load: the last report less the prompt tokens this router sent there since; None when
        # unknown
        if self.reported_free_kv_tokens is None:
            free = self.kv_capacity_tokens or None
        else:
            sent_since = max(0, self.outstanding_prefill_tokens - self.outstanding_prefill_at_report)
            free = max(0, self.reported_free_kv_tokens - sent_since)
        load = predicted(self.reported_load, self.in_flight, self.in_flight_at_report)
        self.free_kv_tokens = free
        self.predicted_load = load
        self.decoding_load = max(0, load - self.prefill_parts)
        self.relative_load = load / max(self.max_num_seqs, 1)
        self.predicted_prefill_tokens = predicted(self.reported_prefill_tokens, self.outstanding_prefill_tokens,
                                                  self.outstanding_prefill_at_report)
