"""A host-memory KV tier behind a real vLLM (CPU) engine (`--kv-host-blocks`, Tandem's
connector: `connector.vllm.host_scheduler`).

One worker whose own KV cache holds about 40 blocks, with 128 host slots behind it: a
prompt, then enough other prompts to push its blocks out of vLLM's cache, then the prompt
again. The second time its blocks are loaded from the host tier (the engine reports them
cached), and the answer is the one a plain engine (no host tier) gives. The worker's KV
events, what the router's index ingests, say so block by block: each of the prompt's blocks
moved to the host tier when vLLM evicted it, and back to the device tier when it was loaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from services.worker.vllm.spec import kv_cache_settings  # noqa: E402
from shared.block_hash import block_hash_chain  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.codec import Codec  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import KvEventBatch, WorkerRole  # noqa: E402
from shared.schemas.kv_events import BlockRemoved, BlocksMoved, BlockStored  # noqa: E402
from shared.subjects import Subjects  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.stack_fixtures import running  # noqa: E402
from tests.vllm.conftest import BLOCK, References, vllm_args, vllm_stack  # noqa: E402
from tests.vllm.workload import MAX_TOKENS, SingleEngine, prompt_of  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

DEVICE_BLOCKS = 40  # vLLM's own cache (at least max_model_len's 16 blocks)
HOST_BLOCKS = 128
FLOOD = 8  # prompts of 7 full blocks each after the first: 56 blocks, more than the device holds


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    kv_cache_gib = float(kv_cache_settings(DEVICE_BLOCKS, BLOCK, tiny_model_dir)["vllm_kv_cache_gib"])
    args = vllm_args(0, "--kv-host-blocks", str(HOST_BLOCKS), kv_cache_gib=kv_cache_gib)
    specs = (WorkerSpec(worker_id="h1", role=WorkerRole.BOTH, extra_args=args),)
    with running(vllm_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-host-tier"), specs)) as stack:
        yield stack


class Tiers:
    """Each Tandem chain hash's tier history ("gone": removed), from the worker's KV events."""

    def __init__(self) -> None:
        self.chain_of: dict[int, int] = {}  # engine hash -> chain hash
        self.history: dict[int, list[str]] = {}  # chain hash -> tiers, in order
        self._codec = Codec(KvEventBatch)

    async def on_message(self, msg) -> None:
        for event in self._codec.decode(msg.data).events:
            if isinstance(event, BlockStored) and event.chain_hashes:
                for engine_hash, chain_hash in zip(event.block_hashes, event.chain_hashes):
                    self.chain_of[engine_hash] = chain_hash
                    self.history.setdefault(chain_hash, []).append(event.tier)
            elif isinstance(event, BlocksMoved | BlockRemoved):
                tier = event.tier if isinstance(event, BlocksMoved) else "gone"
                for engine_hash in event.block_hashes:
                    if engine_hash in self.chain_of:
                        self.history.setdefault(self.chain_of[engine_hash], []).append(tier)


async def test_evicted_blocks_come_back_from_the_host_tier(stack: LocalStack, stack_bus: Bus, tiny_model_dir: str,
                                                           references: References) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    engine = SingleEngine(stack_bus, stack.config.namespace, "h1", tokenizer.model_name)
    tiers = Tiers()
    await stack_bus.client.subscribe(Subjects(stack.config.namespace).kv_events("h1"), cb=tiers.on_message)
    prompt = references.workload.prompts[-3]  # 1000 tokens: 7 full blocks
    chain = block_hash_chain(prompt, BLOCK)[: len(prompt) // BLOCK]
    assert len(chain) == 7

    assert await engine.answer(prompt, MAX_TOKENS) == references.of(prompt)
    assert engine.cached_tokens == 0
    for seed in range(FLOOD):
        await engine.answer(prompt_of(9000 + seed, 1000, tokenizer.vocab_size), 2)
    await wait_for(lambda: all(tiers.history.get(h, [])[-1:] == ["host"] for h in chain), 10.0,
                   lambda: f"the prompt's blocks moved to the host tier: {[tiers.history.get(h) for h in chain]}",
                   interval_s=0.1)

    assert await engine.answer(prompt, MAX_TOKENS) == references.of(prompt)
    assert engine.cached_tokens == len(chain) * BLOCK  # loaded from the host tier, not computed
    await wait_for(lambda: all(tiers.history.get(h, [])[-1:] == ["device"] for h in chain), 10.0,
                   lambda: f"the prompt's blocks back in the device tier: {[tiers.history.get(h) for h in chain]}",
                   interval_s=0.1)
    assert all(tiers.history[h] == ["device", "host", "device"] for h in chain), tiers.history
