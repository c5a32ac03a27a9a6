"""Two models with different vocabularies behind one router, on real vLLM (CPU) engines: one
worker of each (role both, a core each), the router started with the first model's directory
only; the second is served with the tokenizer of the directory its worker registers.

Each model's text prompts, tokenized by the router, are answered exactly as its engine
answers the ids its own tokenizer gives (asked directly over the request plane, after the
router, so the router's request finds no cached prefix); `/v1/models` lists both with the
engines' context lengths.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.stack_fixtures import running  # noqa: E402
from tests.vllm.conftest import vllm_args, vllm_stack  # noqa: E402
from tests.vllm.workload import MAX_TOKENS, SingleEngine, as_router_text  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

TEXTS = ["The river runs past the mill", "Under the old stone bridge the water turns green and slow, and the "
         "ferryman counts his coins one by one while the fog comes down the valley"]


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, small_model_dir: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    specs = (WorkerSpec(worker_id="tiny-1", role=WorkerRole.BOTH, extra_args=vllm_args(0)),
             WorkerSpec(worker_id="small-1", role=WorkerRole.BOTH, model_dir=small_model_dir,
                        extra_args=vllm_args(1)))
    with running(vllm_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-models"), specs)) as stack:
        yield stack


async def test_each_model_answers_as_its_own_engine(stack: LocalStack, stack_bus: Bus, tiny_model_dir: str,
                                                    small_model_dir: str, openai_client) -> None:
    tokenizers = {"tiny": Tokenizer.from_model_dir(tiny_model_dir), "small": Tokenizer.from_model_dir(small_model_dir)}
    async with httpx.AsyncClient() as http:
        cards: dict[str, int] = {}

        async def both_listed() -> bool:
            cards.update({card["id"]: card["max_model_len"]
                          for card in (await http.get(f"{stack.router_url}/v1/models")).json()["data"]})
            return set(cards) == {"tiny", "small"}

        await wait_for(both_listed, 30.0, lambda: f"both models listed ({cards})", interval_s=0.2)
    assert cards == {"tiny": 2048, "small": 2048}
    client = openai_client(stack.router_url, timeout=120)
    for model, tokenizer in tokenizers.items():
        engine = SingleEngine(stack_bus, stack.config.namespace, f"{model}-1", model)
        for text in TEXTS:
            reply = await client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                                    extra_body={"ignore_eos": True})
            prompt_ids = tokenizer.encode(text)
            assert reply.usage.prompt_tokens == len(prompt_ids), model
            expected = await engine.answer(prompt_ids, MAX_TOKENS)
            assert reply.choices[0].text == as_router_text(tokenizer, prompt_ids, expected), (model, text)
    assert tokenizers["tiny"].encode(TEXTS[1]) != tokenizers["small"].encode(TEXTS[1])
