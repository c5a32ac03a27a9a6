"""Two LoRA adapters of one base model behind the router, in P/D (the whole stack as
processes on sim workers, the official `openai` client).

A request names an adapter as `"tiny:<adapter>"`. Every answer equals a single sim engine
serving that adapter, fed the same tokens; the adapters' answers differ from each other and
from the base model's. The adapter reaches both sides of the pair: the decode worker's pull
of the prefill worker's blocks verifies against the adapter's chain (nothing recomputed).
The same token ids asked of `tiny:alpha`, `tiny:beta` and `tiny` are never found cached
across them by the router's KV index (its routing span's `tandem.max_cached_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.test_disaggregated import as_router_text, metric, metrics_when, reference
from tests.e2e.test_tracing import BLOCK, ClientSpan, received_trace, run_stack
from tests.otlp_receiver import OtlpReceiver
from tests.stack_fixtures import make_stack

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
ADAPTERS = ("alpha", "beta")


@pytest.fixture(scope="module")
def pd_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory,
             receiver: OtlpReceiver) -> Iterator[LocalStack]:
    slots = ("--max-adapters", "2")
    specs = (WorkerSpec(worker_id="p1", role=WorkerRole.PREFILL, extra_args=slots),
             WorkerSpec(worker_id="d1", role=WorkerRole.DECODE, extra_args=slots))
    tracing = ("--trace-exporter", "otlp", "--otlp-endpoint", receiver.endpoint)  # the router's spans only
    yield from run_stack(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("lora-logs"), workers=0,
                                    router_args=(*ALWAYS_DISAGGREGATE, *tracing), specs=specs))


def model_name(tokenizer: Tokenizer, adapter: str) -> str:
    return f"{tokenizer.model_name}:{adapter}" if adapter else tokenizer.model_name


async def complete(client: openai.AsyncOpenAI, model: str, prompt: list[int], traceparent: str = "") -> str:
    headers = {"traceparent": traceparent} if traceparent else None
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_headers=headers)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].text


def prompts(seed: int, count: int) -> list[list[int]]:
    """`count` prompts of 2 to 4 full blocks and a partial one, distinct per `seed`."""
    return [[3 + (seed * 7919 + index * 613 + position * 37) % 2000 for position in range((2 + index % 3) * BLOCK + 5)]
            for index in range(count)]


async def test_each_adapter_answers_as_a_single_engine_serving_it(pd_stack: LocalStack, tiny_model_dir: str,
                                                                  openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url)
    prompt_ids = prompts(1, 4)
    async with httpx.AsyncClient() as http:
        before = (await http.get(f"{pd_stack.metrics_url}/metrics")).text
    answers: dict[str, list[str]] = {}
    for adapter in ("", *ADAPTERS):
        expected = await reference(tokenizer, prompt_ids, MAX_TOKENS, adapter)
        answers[adapter] = [await complete(client, model_name(tokenizer, adapter), ids) for ids in prompt_ids]
        for ids, text, tokens in zip(prompt_ids, answers[adapter], expected):
            assert text == as_router_text(tokenizer, ids, tokens), adapter or "the base model"
    assert len({tuple(texts) for texts in answers.values()}) == 3, "adapters answered alike"

    async with httpx.AsyncClient() as http:
        # every request's prompt was pulled by the decode worker, verified against its adapter's chain
        def since(text: str, source: str) -> float:
            return (metric(text, "tandem_kv_transfer_tokens_total", kind="pull", source=source)
                    - metric(before, "tandem_kv_transfer_tokens_total", kind="pull", source=source))

        full_blocks = 3 * sum(len(ids) // BLOCK * BLOCK for ids in prompt_ids)
        text = await metrics_when(lambda: collector(http, pd_stack), lambda text: since(text, "pulled") >= full_blocks,
                                  lambda text: f"{full_blocks} tokens pulled (pulled {since(text, 'pulled')})")
        assert since(text, "pulled") == full_blocks and since(text, "recomputed") == 0


async def collector(http: httpx.AsyncClient, stack: LocalStack) -> str:
    return (await http.get(f"{stack.metrics_url}/metrics")).text


async def test_no_prefix_hit_crosses_adapters(pd_stack: LocalStack, receiver: OtlpReceiver, tiny_model_dir: str,
                                              openai_client) -> None:
    """The same token ids to `tiny:alpha`, `tiny:beta`, `tiny`, then `tiny:alpha` again: the
    router finds none of them cached but for the second `tiny:alpha`, which finds all."""
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url)
    [shared_ids] = prompts(2, 1)
    shared_ids = shared_ids[: len(shared_ids) // BLOCK * BLOCK]

    async def cached_at_routing(adapter: str) -> int:
        """The most of the prompt the router's KV index found cached on any worker for `adapter`."""
        [expected] = await reference(tokenizer, [shared_ids], MAX_TOKENS, adapter)
        span = ClientSpan()
        text = await complete(client, model_name(tokenizer, adapter), shared_ids, traceparent=span.traceparent)
        assert text == as_router_text(tokenizer, shared_ids, expected), adapter
        found = await received_trace(receiver, span, {"router.route"})
        return found.only("router.route").attributes["tandem.max_cached_tokens"]

    assert [await cached_at_routing(adapter) for adapter in ("alpha", "beta", "", "alpha")] == \
        [0, 0, 0, len(shared_ids)]


async def test_an_adapter_of_an_unknown_model_is_a_404(pd_stack: LocalStack, openai_client) -> None:
    client = openai_client(pd_stack.router_url)
    with pytest.raises(openai.NotFoundError) as raised:
        await client.completions.create(model="large:alpha", prompt="hello", max_tokens=2)
    assert raised.value.body["code"] == "model_not_found"
