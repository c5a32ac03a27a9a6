"""A live role switch on real vLLM (CPU) engines: the prefill worker of a 1P1D stack
becomes a decode worker under streaming load, engine not restarted. No answer fails or
comes back short, and the prompt vLLM cached while the worker was the prefill worker is
a prefix-cache hit in vLLM afterwards (its `num_cached_tokens`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from shared.schemas.orchestrator import CordonWorker, SetWorkerRole  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.e2e.control_plane_helpers import StreamingLoad, command, complete, timed_command  # noqa: E402
from tests.stack_fixtures import request_records  # noqa: E402
from tests.vllm.conftest import BLOCK, pd_pair  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture
def pd_stack(nats_server: EmbeddedNats, tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[LocalStack]:
    yield from pd_pair(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-role-switch"))


async def test_vllm_prefill_worker_switches_to_decode_and_keeps_its_cache(pd_stack: LocalStack, tiny_model_dir: str,
                                                                         openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(pd_stack.router_url, timeout=120)
    async with request_records(pd_stack, "vllm-role-switch") as records:
        cached_prompt = [5 + (i * 11) % 480 for i in range(2 * BLOCK + 20)]
        await client.completions.create(model=tokenizer.model_name, prompt=cached_prompt, max_tokens=4,
                                        temperature=0, extra_body={"ignore_eos": True})
        await wait_for(lambda: any(r.flow == "disaggregated" for r in records), 30, "the warm-up's record")

        load = StreamingLoad(client, tokenizer.model_name, clients=2, max_tokens=6)
        load.start()
        await wait_for(load.wait_answers(4), 60, "answers before the switch")
        outcome, switched_s = await timed_command(pd_stack, SetWorkerRole(worker_id="p1", role=WorkerRole.DECODE))
        assert (await command(pd_stack, CordonWorker(worker_id="d1"))).ok
        cordoned_at = len(records)
        answered = len(load.answers)
        await wait_for(load.wait_answers(answered + 4), 60, "answers after the switch")
        reply = await client.completions.create(model=tokenizer.model_name, prompt=cached_prompt + [7, 8, 9],
                                                max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"
        answers = await load.stop()

        # the router publishes a request's record after its answer went out
        await wait_for(lambda: any(r.prompt_tokens == len(cached_prompt) + 3 for r in records[cordoned_at:]), 10,
                       "the record of the request after the switch")
        [hit] = [r for r in records[cordoned_at:] if r.prompt_tokens == len(cached_prompt) + 3]
        assert hit.worker_id == "p1" and hit.outcome == "ok"
        assert hit.cached_tokens >= 2 * BLOCK, hit
        broken = complete(answers, load.max_tokens)
        assert not broken, f"{len(broken)} of {len(answers)} answers failed or were short: {broken[:3]}"
        assert all(r.outcome == "ok" for r in records), [r for r in records if r.outcome != "ok"]
        print(f"\nvLLM switch acknowledged in {switched_s * 1000:.0f} ms; {len(answers)} streamed answers, "
              f"none failed; vLLM prefix-cache hit after the switch: {hit.cached_tokens} tokens")
