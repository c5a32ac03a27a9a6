"""Index benchmark: Tandem's `KvIndex` beside NVIDIA Dynamo's `RadixTree`, same events.

A simulated fleet serves 8k-token prompts with shared prefixes (Zipf-popular prefix
families with a few home workers each, conversation continuations, some fresh prompts).
Each worker announces only the blocks it does not hold yet, one `BlockStored` per prefill
chunk (16-64 blocks), in one `KvEventBatch` per chunk, as engines publish them. The same
events go to both indexes, pre-built outside the timed loops: `KvEventBatch` objects for
Tandem, JSON bytes for Dynamo (`apply_event` parses them; Tandem computes its chain hashes
from token ids inside `ingest`, Dynamo is handed them). Dynamo's `tokens_hash` is Tandem's
chain hash, its `block_hash` the engine's hash (as a Dynamo publisher would send).

Then 8k-token queries with partial overlaps time `match` / `find_matches` on the same
chains; both must agree on every worker's overlap (a warning on stderr if not).

    python -m bench.index [--quick] [--workers 16,256,1024] [--blocks N]

prints one JSON document (a list of rows) on stdout, progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from services.router.kv_index import KvIndex, block_hashes_for
from shared.block_hash import ROOT_PARENT
from shared.schemas.kv_events import BlockStored, KvEventBatch

MASK64 = (1 << 64) - 1
VOCAB = 128_000
FAMILIES = 256
RESERVOIR = 256  # past prompts kept for continuations and queries
CHUNK_BLOCKS = 50_000  # events generated, then fed to both indexes, per round


def engine_hash(tandem_hash: int) -> int:
    """A stand-in engine hash: content-defined like vLLM's, but not Tandem's."""
    return ((tandem_hash ^ 0x5BD1E9955BD1E995) * 0x9E3779B97F4A7C15) & MASK64


@dataclass
class _Chunk:
    batches: list[KvEventBatch] = field(default_factory=list)
    dynamo_events: list[tuple[int, bytes]] = field(default_factory=list)
    hash_inputs: list[tuple[list[int], int]] = field(default_factory=list)  # (token ids, Tandem parent)
    blocks: int = 0


@dataclass(frozen=True, slots=True)
class _Prompt:
    tokens: list[int]
    chain: list[int]
    worker: int


class _Fleet:
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
            self.families.append((tokens, block_hashes_for(tokens, block_size)))
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
        return tokens, chain + block_hashes_for(tokens[full * self.block_size:], self.block_size, parent_hash=parent)

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

    def serve(self, prompt: _Prompt, chunk: _Chunk) -> None:
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
            tokens = prompt.tokens[start * size:stop * size]
            chunk.batches.append(KvEventBatch(
                worker_id=self.names[prompt.worker], seq=seq, ts=0.0,
                events=[BlockStored(block_hashes=engine, parent_block_hash=parent, token_ids=tokens,
                                    chain_hashes=chain[start:stop],
                                    block_size=size)]))
            chunk.dynamo_events.append((prompt.worker, msgspec.json.encode({
                "event_id": seq,
                "data": {"stored": {"parent_hash": parent, "blocks": [
                    {"block_hash": engine_hash_, "tokens_hash": tandem_hash}
                    for engine_hash_, tandem_hash in zip(engine, chain[start:stop])]}}})))
            chunk.hash_inputs.append((tokens, chain[start - 1] if start else ROOT_PARENT))
            chunk.blocks += stop - start
            start = stop
        if len(self.reservoir) < RESERVOIR:
            self.reservoir.append(prompt)
        else:
            self.reservoir[int(self.rng.integers(RESERVOIR))] = prompt

    def chunks(self, total_blocks: int) -> Iterator[_Chunk]:
        produced = 0
        while produced < total_blocks:
            chunk = _Chunk()
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


def _load_radix_tree() -> type | None:
    try:
        from dynamo.llm import RadixTree
    except Exception as error:  # any import failure means: no Dynamo rows, and say why
        print(f"bench_index: no Dynamo rows: cannot import RadixTree from dynamo.llm "
              f"(PyPI ai-dynamo-runtime): {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return RadixTree


def _percentile_ms(samples_ns: list[int], quantile: float) -> float:
    return round(float(np.percentile(np.asarray(samples_ns), quantile)) / 1e6, 4)


@dataclass
class _IngestTimes:
    """Seconds, wall and CPU (the process's: Dynamo's RadixTree works on a thread of its own)."""

    tandem_wall: float = 0.0
    tandem_cpu: float = 0.0
    dynamo_wall: float = 0.0
    dynamo_cpu: float = 0.0
    hash_cpu: float = 0.0  # Tandem's chain hashing alone: part of tandem_cpu
    decode_cpu: float = 0.0  # msgpack decoding of the batches: the adapter's, not in tandem_cpu
    blocks: int = 0
    events: int = 0


def _ingest(fleet: _Fleet, index: KvIndex, tree, total_blocks: int) -> _IngestTimes:
    times = _IngestTimes()
    decoder = msgspec.msgpack.Decoder(KvEventBatch)
    for round_, chunk in enumerate(fleet.chunks(total_blocks)):
        times.blocks += chunk.blocks
        times.events += len(chunk.batches)
        for impl in ("tandem", "dynamo") if round_ % 2 else ("dynamo", "tandem"):
            if impl == "tandem":
                ingest = index.ingest
                cpu, wall = time.process_time(), time.perf_counter()
                for batch in chunk.batches:
                    ingest(batch)
                times.tandem_wall += time.perf_counter() - wall
                times.tandem_cpu += time.process_time() - cpu
            elif tree is not None:
                apply_event = tree.apply_event
                cpu, wall = time.process_time(), time.perf_counter()
                for worker, event in chunk.dynamo_events:
                    apply_event(worker, event)
                times.dynamo_wall += time.perf_counter() - wall
                times.dynamo_cpu += time.process_time() - cpu
        cpu = time.process_time()
        for token_ids, parent in chunk.hash_inputs:
            block_hashes_for(token_ids, fleet.block_size, parent_hash=parent)
        times.hash_cpu += time.process_time() - cpu
        encoded = [msgspec.msgpack.encode(batch) for batch in chunk.batches]
        cpu = time.process_time()
        for payload in encoded:
            decoder.decode(payload)
        times.decode_cpu += time.process_time() - cpu
        print(f"  workers={fleet.workers} round {round_}: {times.blocks} blocks indexed", file=sys.stderr)
    return times


@dataclass
class _MatchTimes:
    tandem_ns: list[int] = field(default_factory=list)
    dynamo_ns: list[int] = field(default_factory=list)
    request_hash_ns: list[int] = field(default_factory=list)
    disagree_best: int = 0  # queries where the best worker's overlap differs
    disagree_any: int = 0  # queries where any worker's overlap differs


def _match(fleet: _Fleet, index: KvIndex, tree, queries: int) -> _MatchTimes:
    times = _MatchTimes()
    for query in range(queries):
        tokens = fleet.query()
        started = time.perf_counter_ns()
        chain = block_hashes_for(tokens, fleet.block_size)
        times.request_hash_ns.append(time.perf_counter_ns() - started)
        for impl in ("tandem", "dynamo") if query % 2 else ("dynamo", "tandem"):
            if impl == "tandem":
                started = time.perf_counter_ns()
                overlaps = index.match(chain)
                times.tandem_ns.append(time.perf_counter_ns() - started)
            elif tree is not None:
                started = time.perf_counter_ns()
                scores = tree.find_matches(chain).scores
                times.dynamo_ns.append(time.perf_counter_ns() - started)
        if tree is not None:
            theirs = {fleet.names[worker]: score for (worker, _dp_rank), score in scores.items()}
            times.disagree_best += max(overlaps.values(), default=0) != max(theirs.values(), default=0)
            times.disagree_any += overlaps != theirs
    return times


def _bench_one(workers: int, total_blocks: int, prompt_tokens: int, block_size: int, queries: int,
               seed: int, radix_tree: type | None) -> list[dict]:
    fleet = _Fleet(workers, block_size, prompt_tokens, seed)
    index = KvIndex()
    for name in fleet.names:
        index.add_worker(name, block_size)
    tree = radix_tree() if radix_tree is not None else None
    ingested = _ingest(fleet, index, tree, total_blocks)
    blocks = ingested.blocks
    stats = index.stats()
    assert sum(stats.blocks_per_worker.values()) == blocks, "every announced block is indexed"
    assert not stats.unsynced_workers
    matched = _match(fleet, index, tree, queries)
    if matched.disagree_best or matched.disagree_any:
        print(f"bench_index: WARNING workers={workers}: Tandem and Dynamo disagree on the best overlap "
              f"for {matched.disagree_best} and on some worker's for {matched.disagree_any} of {queries} "
              f"queries", file=sys.stderr)
    memory = index.memory_bytes()
    rows = [{
        "impl": "tandem", "workers": workers, "blocks": blocks, "events": ingested.events,
        "ingest_blocks_per_s": round(blocks / ingested.tandem_wall),
        "ingest_blocks_per_cpu_s": round(blocks / ingested.tandem_cpu),
        "match_p50_ms": _percentile_ms(matched.tandem_ns, 50),
        "match_p99_ms": _percentile_ms(matched.tandem_ns, 99),
        # Tandem's ingest hashes token ids itself; Dynamo is handed its hashes. That share,
        # and Tandem's ingest without it:
        "hash_ns_per_block": round(ingested.hash_cpu / blocks * 1e9),
        "index_only_blocks_per_cpu_s": round(blocks / max(ingested.tandem_cpu - ingested.hash_cpu, 1e-9)),
        # Not in ingest: msgpack decoding of the batches (the adapter's work).
        "decode_ns_per_block": round(ingested.decode_cpu / blocks * 1e9),
        "request_hash_p50_ms": _percentile_ms(matched.request_hash_ns, 50),
        "distinct_blocks": stats.total_blocks,
        "bytes_per_block": round(memory / blocks),
    }]
    if tree is not None:
        rows.append({
            "impl": "dynamo", "workers": workers, "blocks": blocks, "events": ingested.events,
            "ingest_blocks_per_s": round(blocks / ingested.dynamo_wall),
            "ingest_blocks_per_cpu_s": round(blocks / ingested.dynamo_cpu),
            "match_p50_ms": _percentile_ms(matched.dynamo_ns, 50),
            "match_p99_ms": _percentile_ms(matched.dynamo_ns, 99),
            "queries_agreeing_on_best_overlap": queries - matched.disagree_best,
            "queries_agreeing_on_every_worker": queries - matched.disagree_any,
        })
    return rows


def run_index_bench(workers_list: Sequence[int] = (16, 256, 1024), total_blocks: int = 1_000_000,
                    prompt_tokens: int = 8192, block_size: int = 16, seed: int = 0, queries: int = 1000,
                    dynamo: bool = True) -> list[dict]:
    """One row per implementation and fleet size; see the module docstring."""
    radix_tree = _load_radix_tree() if dynamo else None
    rows: list[dict] = []
    for workers in workers_list:
        print(f"bench_index: {workers} workers, {total_blocks} blocks, {prompt_tokens}-token prompts, "
              f"block size {block_size}", file=sys.stderr)
        rows.extend(_bench_one(workers, total_blocks, prompt_tokens, block_size, queries, seed, radix_tree))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench index", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,256,1024", help="comma-separated fleet sizes")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout (the default anyway)")
    parser.add_argument("--blocks", type=int, default=1_000_000, help="(worker, block) pairs to index")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-dynamo", action="store_true", help="Tandem rows only")
    parser.add_argument("--quick", action="store_true", help="a small run: 4 and 64 workers, 50k blocks")
    args = parser.parse_args(argv)
    workers_list = [int(value) for value in args.workers.split(",")]
    total_blocks, queries = args.blocks, args.queries
    if args.quick:
        workers_list, total_blocks, queries = [4, 64], 50_000, 200
    rows = run_index_bench(workers_list, total_blocks, args.prompt_tokens, args.block_size, args.seed,
                           queries, dynamo=not args.no_dynamo)
    json.dump(rows, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
