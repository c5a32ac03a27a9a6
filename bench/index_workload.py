"""The index benchmark's workload (`bench.index`): a simulated fleet's KV events, a worker's
snapshot, and queries, each built once for Tandem (`KvEventBatch` objects) and for Dynamo
(JSON bytes for `RadixTree.apply_event`) with the same hashes.

A fleet serves 8k-token prompts with shared prefixes (Zipf-popular prefix families with a
few home workers each, conversation continuations, some fresh prompts). Each worker
announces only the blocks it does not hold yet, one `BlockStored` per prefill chunk (16-64
blocks), in one `KvEventBatch` per chunk, as engines publish them, with Tandem's chain
hashes as workers compute them and the token ids (which only a verifying router reads).
Dynamo's `tokens_hash` is Tandem's chain hash, its `block_hash` the engine's hash (as a
Dynamo publisher would send).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np

from shared.block_hash import ROOT_PARENT, block_hash_chain
from shared.schemas.kv_events import AllBlocksCleared, BlockStored, KvEventBatch

MASK64 = (1 << 64) - 1
VOCAB = 128_000
FAMILIES = 256
RESERVOIR = 256  # past prompts kept for continuations and queries
CHUNK_BLOCKS = 50_000  # blocks per chunk: the two indexes take turns going first, chunk by chunk
SNAPSHOT_CHAIN_BLOCKS = 512  # a snapshot's chains: 8k-token prompts of 16-token blocks


def engine_hash(tandem_hash: int) -> int:
    """A stand-in engine hash: content-defined like vLLM's, but not Tandem's."""
    return ((tandem_hash ^ 0x5BD1E9955BD1E995) * 0x9E3779B97F4A7C15) & MASK64


def dynamo_stored(event_id: int, parent: int | None, engine: list[int], chain: list[int]) -> bytes:
    return msgspec.json.encode({"event_id": event_id, "data": {"stored": {"parent_hash": parent, "blocks": [
        {"block_hash": engine_hash_, "tokens_hash": tandem_hash} for engine_hash_, tandem_hash in zip(engine, chain)]}}})


@dataclass
class Chunk:
    batches: list[KvEventBatch] = field(default_factory=list)
    dynamo_events: list[tuple[int, bytes]] = field(default_factory=list)  # (worker, event)
    blocks: int = 0


@dataclass(frozen=True, slots=True)
class _Prompt:
    tokens: list[int]
    chain: list[int]
    worker: int


class Fleet:
    """Engines' prefix caches as sets of Tandem hashes, and the events they publish."""

    def __init__(self, workers: int, block_size: int, prompt_tokens: int, seed: int) -> None:
        self.workers = workers
        self.block_size = block_size
        self.prompt_tokens = prompt_tokens
        self.rng = np.random.default_rng(seed)
        self.held: list[set[int]] = [set() for _ in range(workers)]
        self.seq = [0] * workers
        self.names = [f"w{index}" for index in range(workers)]
        self.families: list[tuple[list[int], list[int]]] = []
        for _ in range(FAMILIES):
            tokens = self._fresh(int(self.rng.integers(prompt_tokens // 8, prompt_tokens * 3 // 4)))
            self.families.append((tokens, block_hash_chain(tokens, block_size)))
        weights = 1.0 / np.arange(1, FAMILIES + 1) ** 1.1
        self.family_weights = weights / weights.sum()
        self.homes = [self.rng.choice(workers, size=min(4, workers), replace=False) for _ in range(FAMILIES)]
        self.reservoir: list[_Prompt] = []

    def _fresh(self, count: int) -> list[int]:
        return self.rng.integers(0, VOCAB, size=count).tolist()

    def _extend(self, prefix_tokens: list[int], prefix_chain: list[int]) -> tuple[list[int], list[int]]:
        """`prefix_tokens` + fresh tokens up to the prompt length, and its full chain."""
        tokens = prefix_tokens + self._fresh(self.prompt_tokens - len(prefix_tokens))
        full = len(prefix_tokens) // self.block_size
        chain = prefix_chain[:full]
        parent = chain[-1] if chain else ROOT_PARENT
        return tokens, chain + block_hash_chain(tokens[full * self.block_size:], self.block_size, parent_hash=parent)

    def prompt(self) -> _Prompt:
        """70% a prefix family (mostly on its home workers), 20% a continuation, 10% fresh."""
        draw = self.rng.random()
        if draw < 0.2 and self.reservoir:
            base = self.reservoir[int(self.rng.integers(len(self.reservoir)))]
            cut = int(self.rng.integers(len(base.tokens) // 4, len(base.tokens)))
            tokens, chain = self._extend(base.tokens[:cut], base.chain)
            worker = base.worker if self.rng.random() < 0.8 else int(self.rng.integers(self.workers))
        elif draw < 0.9:
            family = int(self.rng.choice(FAMILIES, p=self.family_weights))
            tokens, chain = self._extend(*self.families[family])
            homes = self.homes[family]
            worker = int(homes[self.rng.integers(len(homes))] if self.rng.random() < 0.7
                         else self.rng.integers(self.workers))
        else:
            tokens, chain = self._extend([], [])
            worker = int(self.rng.integers(self.workers))
        return _Prompt(tokens, chain, worker)

    def serve(self, prompt: _Prompt, chunk: Chunk) -> None:
        """The worker prefills the uncached part and announces it chunk by chunk."""
        held = self.held[prompt.worker]
        chain = prompt.chain
        start = 0
        while start < len(chain) and chain[start] in held:
            start += 1
        held.update(chain[start:])
        size = self.block_size
        while start < len(chain):
            stop = min(len(chain), start + int(self.rng.integers(16, 65)))
            engine = [engine_hash(block_hash) for block_hash in chain[start:stop]]
            parent = engine_hash(chain[start - 1]) if start else None
            self.seq[prompt.worker] += 1
            seq = self.seq[prompt.worker]
            chunk.batches.append(KvEventBatch(
                worker_id=self.names[prompt.worker], seq=seq, ts=0.0,
                events=[BlockStored(block_hashes=engine, parent_block_hash=parent,
                                    token_ids=prompt.tokens[start * size:stop * size], block_size=size,
                                    chain_hashes=chain[start:stop])]))
            chunk.dynamo_events.append((prompt.worker, dynamo_stored(seq, parent, engine, chain[start:stop])))
            chunk.blocks += stop - start
            start = stop
        if len(self.reservoir) < RESERVOIR:
            self.reservoir.append(prompt)
        else:
            self.reservoir[int(self.rng.integers(RESERVOIR))] = prompt

    def chunks(self, total_blocks: int) -> Iterator[Chunk]:
        produced = 0
        while produced < total_blocks:
            chunk = Chunk()
            while chunk.blocks < min(CHUNK_BLOCKS, total_blocks - produced):
                self.serve(self.prompt(), chunk)
            produced += chunk.blocks
            yield chunk

    def query(self) -> list[int]:
        """A request's token ids: 40% a past prompt cut short, 40% a family, 20% fresh."""
        draw = self.rng.random()
        if draw < 0.4 and self.reservoir:
            base = self.reservoir[int(self.rng.integers(len(self.reservoir)))]
            return self._extend(base.tokens[:int(self.rng.integers(len(base.tokens)))], base.chain)[0]
        if draw < 0.8:
            return self._extend(*self.families[int(self.rng.choice(FAMILIES, p=self.family_weights))])[0]
        return self._extend([], [])[0]


class Snapshot:
    """One worker's whole cache as it answers a snapshot request: `AllBlocksCleared`, then one
    `BlockStored` (with chain hashes) per cached chain of `SNAPSHOT_CHAIN_BLOCKS` blocks; and
    the same chains as Dynamo events. `changed()` is the state after a short gap: 1% of the
    chains evicted, as many new ones cached."""

    def __init__(self, worker_id: str, blocks: int, block_size: int, seed: int) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        self.chains = [self._chain() for _ in range(max(1, blocks // SNAPSHOT_CHAIN_BLOCKS))]

    def _chain(self) -> list[int]:
        return self.rng.integers(1, 1 << 63, size=SNAPSHOT_CHAIN_BLOCKS, dtype=np.int64).tolist()

    @property
    def blocks(self) -> int:
        return len(self.chains) * SNAPSHOT_CHAIN_BLOCKS

    def changed(self, share: float = 0.01) -> Snapshot:
        other = Snapshot.__new__(Snapshot)
        other.worker_id, other.block_size, other.rng = self.worker_id, self.block_size, self.rng
        swapped = max(1, round(len(self.chains) * share))
        other.chains = self.chains[swapped:] + [self._chain() for _ in range(swapped)]
        return other

    def events(self, *, token_ids: bool = False) -> list[BlockStored]:
        size = self.block_size
        events = []
        for chain in self.chains:
            tokens = self.rng.integers(0, VOCAB, size=len(chain) * size).tolist() if token_ids else []
            events.append(BlockStored(block_hashes=[engine_hash(block_hash) for block_hash in chain],
                                      parent_block_hash=None, token_ids=tokens, block_size=size, chain_hashes=chain))
        return events

    def batch(self, seq: int, *, token_ids: bool = False) -> KvEventBatch:
        return KvEventBatch(worker_id=self.worker_id, seq=seq, ts=0.0,
                            events=[AllBlocksCleared(), *self.events(token_ids=token_ids)])

    def dynamo_events(self) -> list[bytes]:
        return [dynamo_stored(index, None, [engine_hash(block_hash) for block_hash in chain], chain)
                for index, chain in enumerate(self.chains)]
