"""Push mode between real vLLM (CPU) engines, through the whole stack (router with
`--pd-transfer push`, two vLLM workers as processes, the official openai client).

The decode worker has vLLM pin fresh blocks for the prompt and announces them; the
prefill worker's connector writes each layer of each completed prompt block into them
from vLLM's per-layer save hook (the blocks it reused from its prefix cache whole, at the
prompt's last step; the partial last block whole, at that step too) and sends `PushDone`
with the first token and one checksum per block; the decode worker verifies, caches the
full blocks that verified in vLLM, copies a verified partial last block into the request's
own, and computes only the rest: the pushed first token, where every block arrived.
Every answer equals a single vLLM engine's (`references`); vLLM's own prompt-token
counters on the decode worker show the pushed tokens were not computed; with about one
write in seven broken, the answers are still identical and only what failed (from the first
failed block on: vLLM's computed prefix has no holes) is computed; the prefill worker's
log shows layer k written while layer k+1 was computed.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from tests.vllm.conftest import BLOCK, References, pd_pair  # noqa: E402
from tests.vllm.observer import Observer, complete, observing  # noqa: E402
from tests.vllm.workload import MAX_TOKENS, as_router_text, prompt_of  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

PUSH = ("--pd-transfer", "push")
# The prefill worker's writes skip about one block in seven (chosen by the reader's block id):
# some reported failed, others reported written (only the reader's checksums catch those).
# Every prompt's partial last block is pushed too, so a larger share would spare no push.
WRITE_FAULTS = ("--kv-fault-fail-fraction", "0.08", "--kv-fault-corrupt-fraction", "0.06", "--kv-fault-seed", "11")
REASON = re.compile(r"(\d+) block\(s\) not written, (\d+) did not verify")
PUSH_LINE = re.compile(r"push (\S+) to d1: (\d+) of (\d+) block\(s\) written.*later layer was computed: (\[[^\]]*\])")


def push_lines(log_dir: Path) -> list[tuple[str, int, int, list[int]]]:
    """The prefill worker's push log lines: (request id, blocks written, blocks, overlapped layers)."""
    text = (log_dir / "p1.log").read_text(errors="replace")
    return [(m[1], int(m[2]), int(m[3]), ast.literal_eval(m[4])) for m in PUSH_LINE.finditer(text)]


async def push_record(observer: Observer, seen: int, length: int):
    await wait_for(lambda: [r for r in observer.records[seen:] if r.kind == "push"], 10,
                   f"the push record of the {length}-token prompt")
    assert not [r for r in observer.records[seen:] if r.kind == "pull"], "the router chose pull"
    [record] = [r for r in observer.records[seen:] if r.kind == "push"]
    assert record.worker_id == "d1" and record.blocks == -(-length // BLOCK)  # the partial last block too
    pulled = min(record.blocks_ok * BLOCK, length)  # the leading blocks, the partial one by its tokens
    assert (record.pulled_tokens, record.recomputed_tokens) == (pulled, length - pulled)
    return record


def kv_block_bytes(model_dir: str) -> int:
    """One block's K and V in every layer and KV head of the model, in bfloat16 (vLLM-CPU's)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * BLOCK * 2


class ObservedStack:
    """A class's stack (its own `stack` fixture) watched by one observer."""

    @pytest.fixture(scope="class")
    @classmethod
    async def observer(cls, stack: LocalStack) -> AsyncIterator[Observer]:
        async with observing(stack) as watcher:
            yield watcher


class TestPush(ObservedStack):
    @pytest.fixture(scope="class")
    @classmethod
    def log_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tmp_path_factory.mktemp("vllm-1p1d-push")

    @pytest.fixture(scope="class")
    @classmethod
    def stack(cls, references: References, nats_server: EmbeddedNats, tiny_model_dir: str,
              log_dir: Path) -> Iterator[LocalStack]:
        yield from pd_pair(nats_server, tiny_model_dir, log_dir, router_args=PUSH)

    async def test_pushed_output_equals_a_single_engine(self, stack: LocalStack, observer: Observer,
                                                        references: References, tiny_model_dir: str,
                                                        openai_client) -> None:
        tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
        client: openai.AsyncOpenAI = openai_client(stack.router_url, timeout=120)
        prompts = references.workload.prompts
        assert len(prompts) >= 20
        computed_before = await observer.settled("d1", "computed_prompt_tokens_total")
        expected_computed = 0
        for prompt in prompts:  # one at a time: each record is this prompt's
            seen = len(observer.records)
            text = await complete(client, tokenizer.model_name, prompt, MAX_TOKENS)
            assert text == as_router_text(tokenizer, prompt, references.of(prompt)), f"prompt of {len(prompt)}"
            record = await push_record(observer, seen, len(prompt))
            assert record.outcome == "done" and record.blocks_ok == record.blocks, record
            assert record.bytes == record.blocks * kv_block_bytes(tiny_model_dir), record
            # The decode worker's prompt is the prompt plus the pushed first token.
            expected_computed += len(prompt) + 1 - record.pulled_tokens
        # vLLM's own count: the decode worker prefilled only what no pushed block covers,
        # which is the pushed first token alone: the partial last blocks arrived too.
        computed = await observer.settled("d1", "computed_prompt_tokens_total") - computed_before
        assert computed == expected_computed == len(prompts), (computed, expected_computed)
        await observer.assert_clean()

    async def test_a_prompt_the_prefill_worker_has_cached_is_pushed_whole(
            self, stack: LocalStack, observer: Observer, tiny_model_dir: str, openai_client) -> None:
        """The prefill worker reuses the cached blocks (never computed there): written whole."""
        tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
        client: openai.AsyncOpenAI = openai_client(stack.router_url, timeout=120)
        prompt = prompt_of(9000, 700, tokenizer.vocab_size)
        seen = len(observer.records)
        first = await complete(client, tokenizer.model_name, prompt, 4)
        await push_record(observer, seen, len(prompt))  # in before the next one's (it may follow the answer)
        seen = len(observer.records)
        computed_before = await observer.settled("d1", "computed_prompt_tokens_total")
        # The decode worker cached the first push too: ask for a prompt that extends it, so
        # its reader allocates fresh blocks for every block and the writer reuses five.
        extended = prompt + prompt_of(9001, 200, tokenizer.vocab_size)
        text = await complete(client, tokenizer.model_name, extended, 4)
        record = await push_record(observer, seen, len(extended))
        assert record.outcome == "done" and record.blocks_ok == record.blocks == -(-len(extended) // BLOCK)
        computed = await observer.settled("d1", "computed_prompt_tokens_total") - computed_before
        assert computed == 1  # the pushed first token
        assert first and text
        await observer.assert_clean()

    async def test_a_salted_prompt_is_pushed_and_found_under_its_salt(
            self, stack: LocalStack, observer: Observer, tiny_model_dir: str, openai_client) -> None:
        """vLLM's cache_salt: the reader caches the pushed blocks under the salted hashes the
        request's own are (its commit carries the salt), so the decode worker computes only
        what no pushed block covers; the answer is the unsalted prompt's."""
        tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
        client: openai.AsyncOpenAI = openai_client(stack.router_url, timeout=120)
        prompt = prompt_of(9100, 600, tokenizer.vocab_size)
        seen = len(observer.records)
        computed_before = await observer.settled("d1", "computed_prompt_tokens_total")
        salted = await client.completions.create(model=tokenizer.model_name, prompt=prompt, max_tokens=4,
                                                 temperature=0, extra_body={"cache_salt": "tenant-a"})
        record = await push_record(observer, seen, len(prompt))
        assert record.outcome == "done" and record.blocks_ok == record.blocks == -(-len(prompt) // BLOCK)
        computed = await observer.settled("d1", "computed_prompt_tokens_total") - computed_before
        assert computed == 1  # the pushed first token
        assert salted.choices[0].text == await complete(client, tokenizer.model_name, prompt, 4)
        await observer.assert_clean()

    async def test_layer_k_is_written_while_layer_k_plus_1_is_computed(self, stack: LocalStack, log_dir: Path,
                                                                       observer: Observer) -> None:
        lines = push_lines(log_dir)
        assert lines, "the prefill worker logged no push"
        for line in lines[-5:]:
            print("push", line)
        multi = [line for line in lines if line[2] >= 2]
        assert multi and all(written == blocks for _, written, blocks, _ in multi)
        overlapped = [line for line in multi if line[3]]
        assert overlapped, "no layer write was in flight while the next layer was computed"
        text = (log_dir / "p1.log").read_text(errors="replace")
        print([ln for ln in text.splitlines() if "push " in ln and "writes (layer" in ln][-1][:2000])


class TestPushFaults(ObservedStack):
    @pytest.fixture(scope="class")
    @classmethod
    def stack(cls, references: References, nats_server: EmbeddedNats, tiny_model_dir: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
        yield from pd_pair(nats_server, tiny_model_dir, tmp_path_factory.mktemp("vllm-1p1d-push-faults"),
                           prefill_args=WRITE_FAULTS, router_args=PUSH)

    async def test_failed_writes_are_computed_and_output_is_identical(self, stack: LocalStack, observer: Observer,
                                                                     references: References, tiny_model_dir: str,
                                                                     openai_client) -> None:
        tokenizer = Tokenizer.from_model_dir(tiny_model_dir)
        client: openai.AsyncOpenAI = openai_client(stack.router_url, timeout=120)
        before = {name: await observer.settled("d1", name) for name in
                  ("computed_prompt_tokens_total", "kv_recomputed_tokens_total")}
        expected_computed = 0
        records = []
        for prompt in references.workload.fault_prompts:
            seen = len(observer.records)
            text = await complete(client, tokenizer.model_name, prompt, MAX_TOKENS)
            assert text == as_router_text(tokenizer, prompt, references.of(prompt)), f"prompt of {len(prompt)}"
            record = await push_record(observer, seen, len(prompt))
            assert record.outcome == ("done" if record.blocks_ok == record.blocks else "failed")
            records.append(record)
            expected_computed += len(prompt) + 1 - record.pulled_tokens
        failed = [r for r in records if r.outcome == "failed"]
        assert failed and len(failed) < len(records), "the injection must break some pushes and spare others"
        reasons = [tuple(map(int, REASON.search(r.reason).groups())) for r in failed]
        assert sum(n for n, _ in reasons) and sum(n for _, n in reasons), (
            f"both kinds of broken write, reported and caught by checksum: {reasons}")
        after = {name: await observer.settled("d1", name) for name in before}
        assert after["computed_prompt_tokens_total"] - before["computed_prompt_tokens_total"] == expected_computed
        assert after["kv_recomputed_tokens_total"] - before["kv_recomputed_tokens_total"] == sum(
            r.recomputed_tokens for r in records)
        print(f"\n{len(failed)} of {len(records)} pushes lost blocks; blocks kept/pushed: "
              f"{[(r.blocks_ok, r.blocks) for r in records]}; (not written, did not verify): {reasons}")
        await observer.assert_clean()
