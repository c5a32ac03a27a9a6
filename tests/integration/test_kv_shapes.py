"""KV hand-off between sim workers of unlike shapes (real engines, real NATS, NIXL agents or
the in-memory transport, one per rank): tensor-parallel degrees both ways, block sizes both
ways, a pipeline-split prefill. Every answer equals a single engine's (the sim's tokens
follow its KV bytes: a block mapped to the wrong place perturbs them), every hand-off moved
what the shapes allow and recomputed nothing, and nothing is left pinned or leased."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.block_hash import block_hash_chain
from shared.bus import Bus
from shared.config import BusConfig, KvFaultConfig
from shared.schemas import KvTransferParams
from tests.integration.kv_cluster import TRANSPORTS, Cluster, prompts, push_disaggregated, transport_cluster

TP2 = {"tensor_parallel": 2}
TP4 = {"tensor_parallel": 4}
PAIRS = {
    "tp2-to-tp4": (TP2, TP4),
    "tp4-to-tp2": (TP4, TP2),
    "bs32-to-bs16": ({"block_size": 32}, {"block_size": 16}),
    "bs16-to-bs32": ({"block_size": 16}, {"block_size": 32}),
    "pp2tp2-bs16-to-tp1-bs32": ({"pipeline_parallel": 2, "tensor_parallel": 2}, {"block_size": 32}),
    "tp4-bs32-to-pp4-bs16": ({"tensor_parallel": 4, "block_size": 32}, {"pipeline_parallel": 4}),
}


@pytest.fixture(params=TRANSPORTS)
async def cluster(bus: Bus, bus_config: BusConfig, request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async for nodes in transport_cluster(bus, bus_config, request.param):
        yield nodes


def moved_tokens(prompt_tokens: int, holder_size: int, reader_size: int) -> int:
    """What a pull of a prompt's full holder blocks lands: whole blocks of both sides."""
    held = prompt_tokens // holder_size * holder_size
    return held // max(holder_size, reader_size) * max(holder_size, reader_size)


@pytest.mark.parametrize("pair", list(PAIRS))
async def test_a_pull_between_unlike_shapes_gives_the_single_engines_answer(cluster: Cluster, pair: str) -> None:
    prefill_shape, decode_shape = PAIRS[pair]
    await cluster.add("single")
    await cluster.add("prefill", shape=prefill_shape)
    decode = await cluster.add("decode", shape=decode_shape)
    holder_size, reader_size = prefill_shape.get("block_size", 16), decode_shape.get("block_size", 16)
    for prompt in prompts():
        expected, _ = await cluster.generate("single", prompt, 12)
        before = decode.engine.load().computed_prompt_tokens_total
        got, _, d_done = await cluster.disaggregated("prefill", "decode", prompt, 12)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        moved = moved_tokens(len(prompt), holder_size, reader_size)
        assert (d_done.pulled_tokens, d_done.recomputed_tokens) == (moved, 0), f"prompt of {len(prompt)} tokens"
        computed = decode.engine.load().computed_prompt_tokens_total - before
        assert computed == len(prompt) + 1 - moved  # the rest of the prompt and the first token
    pulls = [record for record in cluster.records if record.kind == "pull" and record.blocks]
    assert pulls and all(record.outcome == "done" and record.bytes > 0 for record in pulls)
    await cluster.assert_clean()


async def test_faults_between_unlike_shapes_recompute_only_what_failed(cluster: Cluster) -> None:
    await cluster.add("single")
    await cluster.add("prefill", shape=TP2)
    decode = await cluster.add("decode", shape={"tensor_parallel": 4, "block_size": 32},
                               faults=KvFaultConfig(corrupt_fraction=0.3, seed=4))
    recomputed = sum(done.recomputed_tokens for done in await cluster.disaggregated_prompts(8))
    assert recomputed > 0, "the injection should have corrupted some blocks"
    assert recomputed == decode.kv.totals.recomputed_tokens
    await cluster.assert_clean()


async def test_a_prefix_pull_from_a_holder_of_another_shape(cluster: Cluster) -> None:
    await cluster.add("single")
    await cluster.add("holder", shape={"tensor_parallel": 2, "block_size": 32})
    puller = await cluster.add("puller", shape={"pipeline_parallel": 2})
    turn1 = prompts()[-1]
    out1, _ = await cluster.generate("holder", turn1, 40)
    turn2 = turn1 + out1 + [7, 8, 9, 10, 11]
    expected, _ = await cluster.generate("single", turn2, 8)
    hashes = block_hash_chain(turn2, 32)  # the holder's chain: a router names the holder's blocks
    before = puller.engine.load().computed_prompt_tokens_total
    got, done = await cluster.generate("puller", turn2, 8, KvTransferParams(prefix_holder="holder",
                                                                            prefix_hashes=hashes))
    assert got == expected
    held = len(block_hash_chain(turn1 + out1[:-1], 32)) * 32  # the last generated token has no KV yet
    assert done.pulled_tokens == held and done.recomputed_tokens == 0
    assert puller.engine.load().computed_prompt_tokens_total - before == len(turn2) - held
    assert cluster.records[-1].kind == "prefix_pull" and cluster.records[-1].outcome == "done"
    await cluster.assert_clean()


@pytest.mark.parametrize("pair", ["tp2-to-tp4", "tp4-to-tp2"])
async def test_a_push_between_unlike_tensor_parallel_degrees(cluster: Cluster, pair: str) -> None:
    prefill_shape, decode_shape = PAIRS[pair]
    await cluster.add("single")
    await cluster.add("prefill", shape={**prefill_shape, "pipeline_parallel": 2})
    await cluster.add("decode", shape=decode_shape)
    for prompt in prompts():
        expected, _ = await cluster.generate("single", prompt, 10)
        got, d_done = await push_disaggregated(cluster, "prefill", "decode", prompt, 10)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        assert d_done.pulled_tokens == (len(prompt) // 16) * 16 and d_done.recomputed_tokens == 0
    pushes = [record for record in cluster.records if record.kind == "push" and record.blocks]
    assert pushes and all(record.outcome == "done" for record in pushes)
    await cluster.assert_clean()
