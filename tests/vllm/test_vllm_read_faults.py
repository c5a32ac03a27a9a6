"""Both engines' pulls read through the same fault wrapper (`connector.faults.FaultInjectingReader`)
and the same read (`connector.block_io.read_verified`): with one fault configuration, the
sim's reader (its transport, wrapped as the sim's data plane wraps it) and vLLM's
worker-side reader (`connector.vllm.connector_worker.WorkerSide`, NIXL reads into vLLM's
KV pages, as in vLLM's model worker) fail, retry and recover exactly the same blocks.

No vLLM engine: the worker side runs in this process over torch tensors shaped like vLLM's
layer-major KV cache (it needs the vLLM venv's torch and NIXL).
"""

from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np
import pytest

from connector.agent_types import KvAgentConfig
from connector.block_io import read_verified
from connector.faults import FaultInjectingTransport, chosen
from connector.memory_transport import MemoryFabric, MemoryTransport
from connector.nixl_agent import nixl_available
from connector.vllm.kv_pages import PageGeometry
from connector.vllm.kv_wire import Loaded, LoadSpec
from shared.config import KvFaultConfig, KvRetryConfig

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

from connector.vllm.connector_worker import WorkerSide  # noqa: E402  (needs torch)

LAYERS, BLOCKS, PAGE = 3, 40, 64
HOLDER_BLOCKS = list(range(1, 25))  # read from the holder ...
LOCAL_BLOCKS = list(range(12, 36))  # ... into these
FAULTS = {"permanent": KvFaultConfig(fail_fraction=0.2, corrupt_fraction=0.15, seed=3),
          "transient": KvFaultConfig(fail_fraction=0.2, corrupt_fraction=0.15, fail_times=1, seed=3),
          "cut": KvFaultConfig(cut_after_blocks=10, fail_times=1)}


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


def vllm_side(name: str, faults: KvFaultConfig, seed: int) -> tuple[WorkerSide, Reports]:
    """vLLM's model-worker side over one allocation of layer-major pages, filled at random."""
    geometry = PageGeometry(num_layers=LAYERS, num_blocks=BLOCKS, page_nbytes=PAGE)
    storage = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, geometry.nbytes, dtype=np.uint8))
    layer_nbytes = BLOCKS * PAGE
    kv_caches = {f"layer.{layer}": storage[layer * layer_nbytes:(layer + 1) * layer_nbytes] for layer in range(LAYERS)}
    reports = Reports()
    side = WorkerSide(agent_name=name, agent_config=KvAgentConfig(default_timeout_s=2.0), faults=faults,
                      reports=reports, retry=KvRetryConfig(attempts=1, deadline_ms=2000))
    side.register(kv_caches, geometry)
    return side, reports


def vllm_pull(faults: KvFaultConfig) -> Loaded:
    holder_name = f"holder-{time.monotonic_ns()}"
    holder, _ = vllm_side(holder_name, KvFaultConfig(), seed=1)
    reader, reports = vllm_side(f"reader-{time.monotonic_ns()}", faults, seed=2)
    try:
        reader.load([LoadSpec(request_id="r", transfer_id="t", lease_id="l", agent_name=holder_name,
                              agent_metadata=holder.metadata(), remote_block_ids=HOLDER_BLOCKS,
                              local_block_ids=LOCAL_BLOCKS, checksums=holder.checksums(HOLDER_BLOCKS),
                              cached_blocks=0)])
        deadline = time.monotonic() + 20
        while "r" not in reader.take_loaded():
            assert time.monotonic() < deadline, "the pull did not end"
            time.sleep(0.01)
        [report] = reports.sent
        errors = reader.take_load_errors()  # what vLLM is told failed
        assert [block_id for block_id, good in zip(LOCAL_BLOCKS, report.ok) if not good] == sorted(errors)
        return report
    finally:
        reader.close()
        holder.close()


async def sim_pull(faults: KvFaultConfig) -> tuple[list[bool], int, int]:
    """The sim's reader: its transport wrapped as `connector.sim.transport_builder` wraps it."""
    block_nbytes = LAYERS * PAGE
    fabric = MemoryFabric()
    pools = [np.random.default_rng(seed).integers(0, 256, BLOCKS * block_nbytes, dtype=np.uint8) for seed in (1, 2)]
    holder = MemoryTransport("holder", pools[0], block_nbytes, PAGE, fabric=fabric)
    reader = FaultInjectingTransport(MemoryTransport("reader", pools[1], block_nbytes, PAGE, fabric=fabric), faults,
                                     pools[1], block_nbytes)
    reader.add_peer("holder", holder.metadata())

    def checksum(pool: np.ndarray, block_id: int) -> int:
        return zlib.crc32(pool[block_id * block_nbytes:(block_id + 1) * block_nbytes])

    try:
        read = await read_verified(reader, lambda block_id: checksum(pools[1], block_id), "holder", HOLDER_BLOCKS,
                                   LOCAL_BLOCKS, [checksum(pools[0], block_id) for block_id in HOLDER_BLOCKS],
                                   retry=KvRetryConfig(attempts=1, deadline_ms=2000), timeout_s=2.0)
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
