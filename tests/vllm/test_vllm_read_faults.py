"""vLLM's worker side of a pull (`connector.vllm.connector_worker.WorkerSide`, one per model-
worker rank, NIXL reads into vLLM's layer-major KV pages), in this process over torch
tensors shaped like vLLM's KV cache (no engine; it needs the vLLM venv's torch and NIXL):

- between ranks of unlike shapes (tensor-parallel degree, block size) every rank reads
  exactly its heads, and the bytes land where vLLM's layout puts them;
- with one fault configuration, vLLM's worker side and the sim's reader (the same
  `connector.shaped_read.ShapedRead`, `FaultInjectingReader` and `read_verified` over the
  sim's own memory transports) fail, retry and recover exactly the same blocks.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from connector.agent_types import KvAgentConfig
from connector.block_io import read_verified
from connector.faults import FaultInjectingReader, ReadFaults, chosen
from connector.kv_geometry import KvShape, Tiling, rank_slices
from connector.kv_peer import KvPeer, encode_peer
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.nixl_agent import nixl_available
from connector.rank_transports import RankTransports
from connector.shaped_read import ShapedRead
from connector.token_map import token_segments
from connector.vllm.kv_pages import PageGeometry, cpu_tiling
from connector.vllm.kv_wire import Loaded, LoadSpec, RankAgent, RankChecksums
from shared.codec import Codec
from shared.config import KvFaultConfig, KvRetryConfig

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

from connector.vllm.connector_worker import WorkerSide  # noqa: E402  (needs torch)

LAYERS, HEADS, TOKEN_NBYTES, BLOCKS = 3, 4, 8, 40
HOLDER_BLOCKS = list(range(1, 25))  # read from the holder ...
LOCAL_BLOCKS = list(range(12, 36))  # ... into these
FAULTS = {"permanent": KvFaultConfig(fail_fraction=0.2, corrupt_fraction=0.15, seed=3),
          "transient": KvFaultConfig(fail_fraction=0.2, corrupt_fraction=0.15, fail_times=1, seed=3),
          "cut": KvFaultConfig(cut_after_blocks=10, fail_times=1)}
RETRY = KvRetryConfig(attempts=1, deadline_ms=2000)
# How a head's K and V regions are cut, by block size: vLLM's vectorised CPU kernels' (K by
# dimension, V by token), and one of tiles and runs on both sides, as the AMX kernel keeps
# them at its own sizes (16-token K tiles, V in runs of 16 dimensions, token pairs), which
# need blocks and heads larger than these (`kv_pages.cpu_tiling`).
TILINGS = {"vec": lambda block_size: cpu_tiling("vec", TOKEN_NBYTES // 2, block_size),
           "tiles-and-runs": lambda block_size: Tiling(k_tile_tokens=2, v_groups=2, v_tile_tokens=2)}


def injected(config: KvFaultConfig) -> list[int]:
    """Indices of the blocks the configuration breaks on their first read."""
    cut = len(HOLDER_BLOCKS) if config.cut_after_blocks is None else config.cut_after_blocks
    return [index for index, block_id in enumerate(HOLDER_BLOCKS)
            if index >= cut or chosen(config.seed, "fail", block_id, config.fail_fraction)
            or chosen(config.seed, "corrupt", block_id, config.corrupt_fraction)]


class Reports:
    """vLLM's report socket, kept in a list."""

    def __init__(self) -> None:
        self.sent: list[Loaded] = []

    def send(self, report: Loaded) -> None:
        self.sent.append(report)


class Engine:
    """The model-worker ranks of one vLLM engine of a shape, each over its random KV pages."""

    def __init__(self, name: str, *, tensor_parallel: int, block_size: int, faults: KvFaultConfig = KvFaultConfig(),
                 seed: int = 0, tiling: str = "vec") -> None:
        self.name, self.reports = name, Reports()
        self.ranks: list[WorkerSide] = []
        for part in rank_slices(LAYERS, HEADS, tensor_parallel):
            geometry = PageGeometry(num_layers=LAYERS, num_blocks=BLOCKS,
                                    page_nbytes=part.num_heads * 2 * block_size * TOKEN_NBYTES)
            storage = torch.from_numpy(np.random.default_rng(seed + part.rank).integers(
                0, 256, geometry.nbytes, dtype=np.uint8))
            layer_nbytes = BLOCKS * geometry.page_nbytes
            side = WorkerSide(agent_name=f"{name}-r{part.rank}", part=part, num_layers=LAYERS, num_kv_heads=HEADS,
                              tensor_parallel=tensor_parallel, block_size=block_size,
                              agent_config=KvAgentConfig(default_timeout_s=2.0, cuda_ipc_reads=False), faults=faults,
                              reports=self.reports, retry=RETRY,
                              tiling=TILINGS[tiling](block_size))
            side.register({f"layer.{layer}": storage[layer * layer_nbytes:(layer + 1) * layer_nbytes]
                           for layer in range(LAYERS)}, geometry)
            self.ranks.append(side)

    def peer(self) -> bytes:
        ranks = [Codec(RankAgent).decode(side.metadata()) for side in self.ranks]
        shape = KvShape(block_size=ranks[0].geometry.block_size, num_layers=LAYERS, num_kv_heads=HEADS,
                        ranks=[rank.geometry for rank in ranks])
        return encode_peer(KvPeer(agent_name=self.name, shape=shape, rank_agents=[rank.agent_name for rank in ranks],
                                  rank_metadata=[rank.metadata for rank in ranks]))

    def checksums(self, block_ids: list[int], tokens: int) -> list[int]:
        """The holder's checksums of blocks holding `tokens` tokens (the last one maybe partial)."""
        size = self.ranks[0].rank.block_size
        units = [[(block, 0, min(size, tokens - index * size))] for index, block in enumerate(block_ids)]
        flat = [0] * (len(block_ids) * HEADS)
        for side in self.ranks:
            part = Codec(RankChecksums).decode(side.checksums(units))
            for unit in range(len(block_ids)):
                for column, head in enumerate(part.heads):
                    flat[unit * HEADS + head] = part.values[unit * len(part.heads) + column]
        return flat

    def vector(self, block: int, layer: int, head: int, kv: int, token: int) -> np.ndarray:
        """One token's K or V vector, its runs' shares put together."""
        side = next(side for side in self.ranks if head in side.rank.heads)
        groups = side.rank.tiling(kv)[0]
        region = side._region  # noqa: SLF001  (the test reads the pages)
        return np.concatenate([region[start:start + TOKEN_NBYTES // groups] for start in (
            side.rank.address(block, layer, head, kv, token, group) for group in range(groups))])

    def close(self) -> None:
        for side in self.ranks:
            side.close()


def pull(holder: Engine, reader: Engine, holder_blocks: list[int], local_blocks: list[int], tokens: int) -> Loaded:
    """One pull, every rank of the reader reading its share; their reports merged as the
    Tandem worker merges them."""
    spec = LoadSpec(request_id="r", transfer_id="t", lease_id="l", agent_name=holder.name,
                    agent_metadata=holder.peer(), remote_block_ids=holder_blocks, local_block_ids=local_blocks,
                    checksums=holder.checksums(holder_blocks, tokens), cached_blocks=0,
                    block_size=holder.ranks[0].rank.block_size, tokens=tokens)
    for side in reader.ranks:
        side.load([spec])
    deadline = time.monotonic() + 20
    pending = list(reader.ranks)
    while pending:
        assert time.monotonic() < deadline, "the pull did not end"
        pending = [side for side in pending if "r" not in side.take_loaded()]
        time.sleep(0.01)
    assert len(reader.reports.sent) == len(reader.ranks)
    from connector.vllm.kv_wire import merge_loaded

    return merge_loaded(reader.reports.sent)


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("holder_shape, reader_shape", [((1, 8), (2, 8)), ((2, 8), (4, 4)), ((4, 4), (1, 8)),
                                                        ((2, 4), (1, 8))],
                         ids=["tp1-to-tp2", "tp2-bs8-to-tp4-bs4", "tp4-bs4-to-tp1-bs8", "tp2-bs4-to-tp1-bs8"])
def test_every_rank_reads_its_heads_between_unlike_shapes(holder_shape, reader_shape, tiling: str) -> None:
    holder = Engine(f"holder-{time.monotonic_ns()}", tensor_parallel=holder_shape[0], block_size=holder_shape[1], seed=1,
                    tiling=tiling)
    reader = Engine(f"reader-{time.monotonic_ns()}", tensor_parallel=reader_shape[0], block_size=reader_shape[1],
                    seed=9, tiling=tiling)
    holder_size, reader_size = holder_shape[1], reader_shape[1]
    tokens = 6 * holder_size - 2  # the holder's last block partial, as a prompt's tail (on a tile)
    holder_blocks = [7, 3, 20, 11, 5, 30]
    local_blocks = [2, 9, 4, 33, 17, 8, 25, 1, 12, 14, 6, 29][:-(-tokens // reader_size)]
    try:
        report = pull(holder, reader, holder_blocks, local_blocks, tokens)
        assert report.ok == [True] * 6 and report.used_blocks == 6
        segments = token_segments(holder_blocks, holder_size, local_blocks, reader_size, tokens)
        for token in range(tokens):
            source = (holder_blocks[token // holder_size], token % holder_size)
            target = (local_blocks[token // reader_size], token % reader_size)
            for layer in range(LAYERS):
                for head in range(HEADS):
                    for kv in (0, 1):
                        assert np.array_equal(holder.vector(source[0], layer, head, kv, source[1]),
                                              reader.vector(target[0], layer, head, kv, target[1]))
        assert len(segments) >= 6
    finally:
        reader.close()
        holder.close()


def vllm_pull(faults: KvFaultConfig) -> Loaded:
    holder = Engine(f"holder-{time.monotonic_ns()}", tensor_parallel=1, block_size=4, seed=1)
    reader = Engine(f"reader-{time.monotonic_ns()}", tensor_parallel=1, block_size=4, faults=faults, seed=5)
    try:
        report = pull(holder, reader, HOLDER_BLOCKS, LOCAL_BLOCKS, len(HOLDER_BLOCKS) * 4)
        errors = reader.ranks[0].take_load_errors()  # what vLLM is told failed
        assert [block_id for block_id, good in zip(LOCAL_BLOCKS, report.ok) if not good] == sorted(errors)
        return report
    finally:
        reader.close()
        holder.close()


async def sim_pull(faults: KvFaultConfig) -> tuple[list[bool], int, int]:
    """The sim's reader: its rank transports, read through the same port and wrapper."""
    from services.worker.sim.kv_pool import KvPool

    fabric = MemoryFabric()
    pools = [KvPool(BLOCKS, LAYERS, 4, HEADS * TOKEN_NBYTES // 2, num_kv_heads=HEADS) for _ in range(2)]
    for seed, pool in enumerate(pools):
        pool.regions[0][:] = np.random.default_rng(seed).integers(0, 256, pool.regions[0].size, dtype=np.uint8)
    sides = [RankTransports(name, pool.shape, pool.regions, [MemoryTransport(
        f"{name}-r0", pool.regions[0], pool.shape.ranks[0].block_stride, pool.shape.ranks[0].layer_stride,
        fabric=fabric)]) for name, pool in zip(("holder", "reader"), pools)]
    holder, reader = sides
    reader.add_peer("holder", holder.metadata())
    segments = token_segments(HOLDER_BLOCKS, 4, LOCAL_BLOCKS, 4, len(HOLDER_BLOCKS) * 4)
    shaped = ShapedRead(reader.local_ranks, reader.peer_of("holder"), segments, len(HOLDER_BLOCKS))
    try:
        read = await read_verified(FaultInjectingReader(shaped, ReadFaults(faults), shaped.scribble),
                                   shaped.unit_checksum, "holder", HOLDER_BLOCKS, list(range(len(HOLDER_BLOCKS))),
                                   shaped.expected(pools[0].block_checksums(HOLDER_BLOCKS), len(HOLDER_BLOCKS)),
                                   retry=RETRY, timeout_s=2.0)
    finally:
        reader.close()
        holder.close()
    return read.ok, read.retried, read.recovered


@pytest.mark.parametrize("name", FAULTS)
def test_both_engines_fail_retry_and_recover_the_same_blocks(name: str) -> None:
    faults = FAULTS[name]
    broken = injected(faults)
    assert broken, "the configuration should break some blocks"
    report = vllm_pull(faults)
    sim_ok, sim_retried, sim_recovered = asyncio.run(sim_pull(faults))
    assert report.ok == sim_ok
    assert (report.retried, report.recovered) == (sim_retried, sim_recovered) == (
        len(broken), 0 if faults.fail_times == 0 else len(broken))
    expected_ok = [faults.fail_times > 0 or index not in broken for index in range(len(HOLDER_BLOCKS))]
    assert report.ok == expected_ok
