"""Membership: what a worker registers, and the changes the orchestrator announces."""

from __future__ import annotations

from enum import Enum
from typing import Literal

import msgspec

from shared.compat import KvLayout
from shared.schemas.common import Message


class WorkerRole(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # serves whole requests (single-worker serving)


class WorkerStatus(str, Enum):
    ACTIVE = "active"
    DRAINING = "draining"  # takes no new work, finishes what it has, then leaves
    CORDONED = "cordoned"  # takes no new work, finishes what it has, stays (an admin hold)


class WorkerCapacity(msgspec.Struct, kw_only=True, frozen=True):
    kv_blocks: int
    max_num_seqs: int
    max_model_len: int


class EngineCapabilities(msgspec.Struct, kw_only=True, frozen=True):
    """What an engine's KV data plane can do, advertised in its registration: the router
    chooses how KV moves from these, never from the engine's name."""

    kv_pull: bool = True  # reads leased blocks from a holder (P/D pull, prefix pull)
    kv_push: bool = False  # receives layer-by-layer writes into blocks it allocated
    # moves the KV of requests served with a LoRA adapter (P/D, prefix pull); False: such a
    # request is served whole by one worker, from its own cache
    adapter_kv_transfer: bool = False
    # lends blocks of its host-memory KV tier to a prefix pull (loads them back to lend them);
    # False: a pull reads only its first tier
    host_tier_lending: bool = False


class WorkerRegistration(Message, tag="registration", kw_only=True):
    worker_id: str
    role: WorkerRole
    model: str  # the served model name clients ask for
    engine: str  # the engine's registered name, for people (decisions use `capabilities`)
    block_size: int
    compat_hash: str  # equal hashes can exchange KV blocks
    model_version: str = ""  # the version label in the compat hash (rolling upgrades tell versions apart by it)
    # Where the worker read its model (absolute; "": not said): a router serving several models
    # takes this model's tokenizer and chat template from there
    model_dir: str = ""
    capacity: WorkerCapacity
    kv_transfer: bool = True  # False: no KV data plane (never paired, never asked to pull or lend)
    capabilities: EngineCapabilities = EngineCapabilities()
    status: WorkerStatus = WorkerStatus.ACTIVE
    started_at: float
    heartbeat_at: float
    pid: int = 0
    # Bumped by the worker on every change of role or admin status, so a consumer can tell
    # a fresh registration from a heartbeat of the old one (the orchestrator waits on it).
    generation: int = 0
    # Set by a launcher that restarted the worker (`tandem up`): how often, and how the
    # process before this one ended ("exit 3: ...the vLLM engine died").
    restarts: int = 0
    last_exit: str = ""
    # LoRA adapters of `model` it holds now, and how many it can hold at once (0: serves none);
    # a request naming another adapter makes it load that one (evicting one when all are taken)
    adapters: list[str] = []
    adapter_slots: int = 0
    # What its KV means and how it is cut (tensor- and pipeline-parallel degree, block size):
    # workers of one compatibility hash pair through a mapping whatever their shape
    kv_layout: KvLayout | None = None


class MembershipChange(Message, tag="membership_change", kw_only=True):
    kind: Literal["joined", "updated", "removed"]
    worker_id: str
    reason: str = ""  # "registered", "draining", "heartbeat_lost", "deregistered"
    registration: WorkerRegistration | None = None
