"""Two models with different vocabularies behind one router, each as a prefill and a decode
worker (the whole stack as processes, the official `openai` client).

The router's own model is `tiny` (its `--model-dir`); `small` (a vocabulary of 1024 ids
instead of 2048) is served only because its workers register it, with their model
directory: the router tokenizes its prompts with its own tokenizer. Every answer equals a
single sim engine of that model fed the same tokens; each model's requests are prefilled
by its own prefill worker. The same token ids sent to both models (the same chain hashes)
are never found cached across models by the router's KV index: its routing span
(`tandem.max_cached_tokens`, exported to a test OTLP receiver) says what the index matched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from launch.plan import WorkerSpec
from launch.stack import LocalStack
from services.router.http.serving import without_double_bos
from shared.nats_server import EmbeddedNats
from shared.schemas import WorkerRole
from shared.tokenizer import Tokenizer
from tests.e2e.conftest import ALWAYS_DISAGGREGATE
from tests.e2e.test_disaggregated import as_router_text, metric, metrics_when, reference
from tests.e2e.test_tracing import BLOCK, ClientSpan, received_trace, run_stack
from tests.otlp_receiver import OtlpReceiver
from tests.stack_fixtures import make_stack
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
TEXTS = ["The river runs past the mill", "Under the old stone bridge the water turns green and slow",
         "A lantern swings in the wind while the ferryman counts his coins one by one, twice over, "
         "as the fog comes down the valley and the bells of the far town ring the hour"]


@pytest.fixture(scope="module")
def two_model_stack(nats_server: EmbeddedNats, tiny_model_dir: str, small_model_dir: str,
                    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[LocalStack]:
    specs = (WorkerSpec(worker_id="tiny-p", role=WorkerRole.PREFILL),
             WorkerSpec(worker_id="tiny-d", role=WorkerRole.DECODE),
             WorkerSpec(worker_id="small-p", role=WorkerRole.PREFILL, model_dir=small_model_dir),
             WorkerSpec(worker_id="small-d", role=WorkerRole.DECODE, model_dir=small_model_dir))
    tracing = ("--trace-exporter", "otlp", "--otlp-endpoint", receiver.endpoint)  # the router's spans only
    yield from run_stack(make_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("models-logs"), workers=0,
                                    router_args=(*ALWAYS_DISAGGREGATE, *tracing), specs=specs))


async def complete(client: openai.AsyncOpenAI, model: str, prompt: str | list[int], traceparent: str = "") -> str:
    headers = {"traceparent": traceparent} if traceparent else None
    reply = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_headers=headers)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
    return reply.choices[0].text


async def collector(http: httpx.AsyncClient, stack: LocalStack) -> str:
    return (await http.get(f"{stack.metrics_url}/metrics")).text


def prefilled(collector_text: str) -> dict[str, float]:
    """Prompt tokens each model's prefill worker processed, from the metrics collector."""
    return {model: metric(collector_text, "tandem_worker_prompt_tokens_total", worker=f"{model}-p")
            for model in ("tiny", "small")}


def chat_prompt_ids(tokenizer: Tokenizer) -> list[int]:
    """The chat of the test's one user message, as the router tokenizes it."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[0]}])
    return without_double_bos(tokenizer.encode(prompt), tokenizer.bos_token_id)


async def served_models(http: httpx.AsyncClient, router_url: str) -> dict[str, int]:
    """Once both models' decode workers serve: each listed model's `max_model_len`."""
    listed: dict[str, int] = {}

    async def both_listed() -> bool:
        cards = (await http.get(f"{router_url}/v1/models")).json()["data"]
        listed.clear()
        listed.update({card["id"]: card["max_model_len"] for card in cards})
        return set(listed) == {"tiny", "small"}

    await wait_for(both_listed, 10.0, lambda: f"both models listed (listed: {listed})", interval_s=0.1)
    return listed


async def test_two_models_answer_each_as_its_own_engine(two_model_stack: LocalStack, tiny_model_dir: str,
                                                       small_model_dir: str, openai_client) -> None:
    client = openai_client(two_model_stack.router_url)
    tokenizers = {"tiny": Tokenizer.from_model_dir(tiny_model_dir), "small": Tokenizer.from_model_dir(small_model_dir)}
    assert tokenizers["tiny"].vocab_size != tokenizers["small"].vocab_size
    prompt_ids = {model: [tokenizer.encode(text) for text in TEXTS] for model, tokenizer in tokenizers.items()}
    assert prompt_ids["tiny"] != prompt_ids["small"], "the two vocabularies tokenize the texts alike"
    async with httpx.AsyncClient() as http:
        assert await served_models(http, two_model_stack.router_url) == {"tiny": 2048, "small": 2048}
        router_before = (await http.get(f"{two_model_stack.router_url}/metrics")).text
        prefilled_before = prefilled((await http.get(f"{two_model_stack.metrics_url}/metrics")).text)

    for model, tokenizer in tokenizers.items():
        expected = await reference(tokenizer, prompt_ids[model], MAX_TOKENS)
        answers = await asyncio.gather(*(complete(client, model, text) for text in TEXTS))
        for ids, text, tokens in zip(prompt_ids[model], answers, expected):
            assert text == as_router_text(tokenizer, ids, tokens), model
        chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": TEXTS[0]}],
                                                    max_tokens=MAX_TOKENS, temperature=0)
        chat_ids = chat_prompt_ids(tokenizer)
        [chat_tokens] = await reference(tokenizer, [chat_ids], MAX_TOKENS)
        assert chat.choices[0].message.content == as_router_text(tokenizer, chat_ids, chat_tokens), model

    async with httpx.AsyncClient() as http:
        router_after = (await http.get(f"{two_model_stack.router_url}/metrics")).text
        for name, labels, change in (("tandem_router_route_decisions_total", {"flow": "disaggregated"}, 2 * 4),
                                     ("tandem_router_prefix_pulls_total", {}, 0)):
            assert metric(router_after, name, **labels) - metric(router_before, name, **labels) == change, name

        # each model's prompts were prefilled on its own prefill worker, and no other's
        sent = {model: sum(map(len, prompt_ids[model])) + len(chat_prompt_ids(tokenizer))
                for model, tokenizer in tokenizers.items()}

        def prefilled_since(text: str) -> dict[str, float]:
            return {model: tokens - prefilled_before[model] for model, tokens in prefilled(text).items()}

        await metrics_when(lambda: collector(http, two_model_stack), lambda text: prefilled_since(text) == sent,
                           lambda text: f"prompt tokens per prefill worker {prefilled_since(text)} == {sent}")


async def test_the_kv_index_never_matches_across_models(two_model_stack: LocalStack, receiver: OtlpReceiver,
                                                       tiny_model_dir: str, small_model_dir: str,
                                                       openai_client) -> None:
    """The same token ids (the same chain hashes) sent to `tiny`, then `small`, then `tiny`
    again: the router finds none of them cached for `small`, and all of them for `tiny`."""
    client = openai_client(two_model_stack.router_url)
    tokenizers = {"tiny": Tokenizer.from_model_dir(tiny_model_dir), "small": Tokenizer.from_model_dir(small_model_dir)}
    async with httpx.AsyncClient() as http:
        await served_models(http, two_model_stack.router_url)
    shared_ids = [3 + (i * 37 + 5) % 1000 for i in range(10 * BLOCK)]
    expected = {model: (await reference(tokenizer, [shared_ids], MAX_TOKENS))[0]
                for model, tokenizer in tokenizers.items()}

    async def cached_at_routing(model: str) -> int:
        """The most of the prompt the router's KV index found cached on any worker for `model`."""
        span = ClientSpan()
        text = await complete(client, model, shared_ids, traceparent=span.traceparent)
        assert text == as_router_text(tokenizers[model], shared_ids, expected[model]), model
        found = await received_trace(receiver, span, {"router.route"})
        return found.only("router.route").attributes["tandem.max_cached_tokens"]

    assert await cached_at_routing("tiny") == 0
    assert await cached_at_routing("small") == 0  # `tiny`'s workers hold (or are predicted to hold) all of it
    assert await cached_at_routing("tiny") == len(shared_ids)


async def test_tokenize_uses_the_named_models_tokenizer(two_model_stack: LocalStack, tiny_model_dir: str,
                                                        small_model_dir: str) -> None:
    async with httpx.AsyncClient() as http:
        await served_models(http, two_model_stack.router_url)
        for model, model_dir in (("tiny", tiny_model_dir), ("small", small_model_dir), (None, tiny_model_dir)):
            body = {"prompt": TEXTS[1]} if model is None else {"model": model, "prompt": TEXTS[1]}
            answer = (await http.post(f"{two_model_stack.router_url}/tokenize", json=body)).json()
            assert answer["tokens"] == Tokenizer.from_model_dir(model_dir).encode(TEXTS[1]), model


async def test_an_unknown_model_is_a_404_naming_both(two_model_stack: LocalStack, openai_client) -> None:
    async with httpx.AsyncClient() as http:
        await served_models(http, two_model_stack.router_url)
    client = openai_client(two_model_stack.router_url)
    with pytest.raises(openai.NotFoundError) as raised:
        await client.completions.create(model="large", prompt="hello", max_tokens=2)
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`large`" in error["message"] and "small, tiny" in error["message"]
