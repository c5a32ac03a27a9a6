"""Partial KV transfer failures between real vLLM (CPU) engines, through the whole stack.

The decode worker of a 1P1D cluster breaks a quarter of the blocks it reads (injected in
its transport, chosen by block id). Every answer still equals a single engine's, and the
counters agree on what happened: vLLM keeps the blocks before the first failed one, and
computes the rest of the prompt itself. (vLLM's computed prefix has no holes, so good
blocks after a failed one are computed again; when the failures are the tail, exactly
the failed blocks are.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.vllm.conftest import BLOCK, References, pd_pair  # noqa: E402
from tests.vllm.observer import Observer, complete, observing  # noqa: E402
from tests.vllm.workload import MAX_TOKENS, as_router_text  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

FAULTS = ("--kv-fault-fail-fraction", "0.25", "--kv-fault-seed", "11")


@pytest.fixture(scope="module")
def faulty_stack(references: References, nats_server: EmbeddedNats, tiny_model_dir: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    yield from pd_pair(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-1p1d-faults"), FAULTS)


@pytest.fixture(scope="module")
async def observer(faulty_stack: LocalStack) -> AsyncIterator[Observer]:
    async with observing(faulty_stack) as watcher:
        yield watcher


async def test_failed_blocks_are_recomputed_and_output_is_identical(faulty_stack: LocalStack, observer: Observer,
                                                                   references: References, tiny_model_dir: str,
                                                                   openai_client) -> None:
    tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
    client = openai_client(faulty_stack.router_url, timeout=120)
    before = {name: await observer.settled("d1", name) for name in
              ("computed_prompt_tokens_total", "external_prompt_tokens_total", "kv_recomputed_tokens_total")}
    expected_computed = 0
    pulls = []
    for prompt in references.workload.fault_prompts:  # one at a time: each record is this prompt's
        seen = len(observer.records)
        text = await complete(client, tokenizer.model_name, prompt, MAX_TOKENS)
        assert text == as_router_text(tokenizer, prompt, references.of(prompt)), f"prompt of {len(prompt)} tokens"
        await wait_for(lambda: [r for r in observer.records[seen:] if r.kind == "pull"], 10,
                       f"the pull record of the {len(prompt)}-token prompt")
        [pull] = [r for r in observer.records[seen:] if r.kind == "pull"]
        assert pull.blocks == -(-len(prompt) // BLOCK)  # the full blocks and the partial last one
        assert pull.outcome == ("done" if pull.blocks_ok == pull.blocks else "failed")
        kept = min(pull.blocks_ok * BLOCK, len(prompt))
        assert (pull.pulled_tokens, pull.recomputed_tokens) == (kept, len(prompt) - kept)
        pulls.append(pull)
        # The decode worker's prompt is the prompt plus the prefill worker's first token.
        expected_computed += len(prompt) + 1 - kept
    failed = [p for p in pulls if p.outcome == "failed"]
    assert failed and len(failed) < len(pulls), "the injection must break some transfers and spare others"

    # vLLM's own prompt-token counters (computed here vs received over the connector) and
    # the connector's recomputed count, from the decode worker's load reports.
    after = {name: await observer.settled("d1", name) for name in before}
    assert after["computed_prompt_tokens_total"] - before["computed_prompt_tokens_total"] == expected_computed
    assert after["external_prompt_tokens_total"] - before["external_prompt_tokens_total"] == sum(
        p.pulled_tokens for p in pulls)
    assert after["kv_recomputed_tokens_total"] - before["kv_recomputed_tokens_total"] == sum(
        p.recomputed_tokens for p in pulls)
    print(f"\n{len(failed)} of {len(pulls)} transfers lost blocks; blocks kept/asked: "
          f"{[(p.blocks_ok, p.blocks) for p in pulls]}")
    await observer.assert_clean()
