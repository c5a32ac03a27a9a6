"""Any worker prefills for any other on real vLLM (CPU) engines: two all-round (BOTH)
workers behind a router with `--prefill-from any`, each computing prompts for the other
(the pinned policy's "p>d" hint names the pair), answer exactly as the prefill worker
alone, with every block of the prompt pulled from it and nothing left leased. Where the
router's cost model splits a request on its own is the sim's and the unit tests' subject
(tests/integration/test_router_any_prefill.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.stack_fixtures import observing, request_records, running  # noqa: E402
from tests.vllm.conftest import vllm_args, vllm_stack  # noqa: E402
from tests.vllm.observer import ALWAYS_DISAGGREGATE, LONG_LEASES  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 12
LENGTHS = (300, 520, 777)  # two to six 128-token blocks and a partial tail


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[LocalStack]:
    specs = tuple(WorkerSpec(worker_id=worker_id, role=WorkerRole.BOTH, extra_args=vllm_args(index, *LONG_LEASES))
                  for index, worker_id in enumerate(("a", "b")))
    router_args = (*ALWAYS_DISAGGREGATE, "--routing-policy", "pinned", "--prefill-from", "any")
    with running(vllm_stack(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-any-prefill"), specs,
                            router_args=router_args)) as started:
        yield started


async def test_each_both_worker_prefills_for_the_other_as_one_engine_answers(
        stack: LocalStack, openai_client, tiny_model_dir: str) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(stack.router_url, timeout=180)
    rng = random.Random(54)

    async def answer(prompt: list[int], hint: str) -> str:
        reply = await client.completions.create(model=tokenizer.model_name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True},
                                                extra_headers={"X-Tandem-Worker": hint})
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == MAX_TOKENS
        return reply.choices[0].text

    async with observing(stack, ("a", "b")) as observer, request_records(stack, "any-prefill") as records:
        for length in LENGTHS:
            for prefill, decode in (("a", "b"), ("b", "a")):
                # new to both workers; the prefill worker answers it alone first (the reference), so
                # the split finds it cached there and the decode worker, which never saw it, pulls it
                prompt = [rng.randrange(3, tokenizer.vocab_size) for _ in range(length)]
                alone = await answer(prompt, prefill)
                split = await answer(prompt, f"{prefill}>{decode}")
                assert split == alone, f"{prefill}>{decode}, {length} tokens: {split!r} != {alone!r}"
        await wait_for(lambda: len(records) >= 12, 10, "every request's record")
        pairs = [record for record in records if record.flow == "disaggregated"]
        assert len(pairs) == 6 and all(record.reason == "pinned" for record in records), records
        await wait_for(lambda: len([r for r in observer.records if r.kind == "pull"]) >= 6, 10, "every pull")
        pulls = [record for record in observer.records if record.kind == "pull"]
        assert sorted((record.worker_id, record.peer_worker_id) for record in pulls) == [("a", "b")] * 3 + [
            ("b", "a")] * 3
        assert all(record.outcome == "done" and record.blocks == record.blocks_ok > 0 for record in pulls), pulls
        await observer.assert_clean()
