"""Chats with images through Tandem's 1P1D pair of vLLM (CPU) workers, against vLLM's own
OpenAI server on the same generated vision-language model (`tandem model vision`, an
Idefics3).

The router decodes each image, places its placeholder tokens in the prompt as vLLM's
processor does and salts the blocks they are in with the image's identifier; the prefill
worker runs the vision encoder and the decode worker receives the prompt's KV. Eight chats
with one or two images of different shapes (one of them streamed too) answer the greedy text
vLLM's server answers, with the same usage, each split with its KV transferred. The same text with another image
shares no KV (nothing cached at the prefill worker, and a `cache_hit_threshold` request is
answered "cache_threshold" by the router's index); the same image again is cached, and the
router, hashing each announced block itself, agrees with the workers' chain. The parity
suite's image rows (`parity_cases.IMAGE_CASES`: log-probabilities, several choices, an image
in an earlier turn, streamed usage) answer as vLLM's server does, field by field (`parity`).
With `--pd-transfer push` the prefill worker pushes these prompts' KV, and they answer
alike: the reader caches the written blocks under hashes that take in the images, as the
request's own do. The decode worker's own count of computed prompt tokens shows the KV
arrived and was found: it computed only the prompt's last token (its partial last block
arrives too, pulled or pushed). Each worker keeps its own encoder-cache store, which holds
one entry per image its vision encoder ran on: the prefill worker's holds the chats' images,
the decode worker's none (it gets the pixels, for blocks that might fail to arrive, but never
encodes them).

vLLM's server runs first, alone, with a worker's engine settings, and is stopped before the
first pair starts; each class's pair is stopped before the next starts (two cores).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from connector.encoder_store import SUFFIX  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from services.worker.vllm.options import VllmEngineOptions  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from tests.stack_fixtures import records_arrived, request_records  # noqa: E402
from tests.vllm.conftest import BLOCK, cores, pd_pair  # noqa: E402
from tests.vllm.observer import disaggregated_requests, observing, router_samples  # noqa: E402
from tests.vllm.parity import Answer as CaseAnswer  # noqa: E402
from tests.vllm.parity import ParityCase, assert_answers_like_vllm, vllm_openai_server  # noqa: E402
from tests.vllm.parity import ask as ask_case  # noqa: E402
from tests.vllm.parity_cases import IMAGE_CASES, image_url  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
STREAMING = (False, True)
STORY = ("Under the old stone bridge the water turns green and slow, and the ferryman counts his coins "
         "one by one while the fog comes down the valley and the lamps of the mill go out. ") * 3
# (image sizes, text): one or two images, square, tall, wide, tiny and large
CHATS = [
    ([(64, 64)], "What is in the picture? " + STORY),
    ([(30, 100)], "Describe this tall picture. " + STORY),
    ([(200, 50)], "Describe this wide picture. " + STORY),
    ([(20, 20)], "What colour is this? " + STORY),
    ([(64, 64), (200, 50)], "Compare the two pictures. " + STORY),
    ([(56, 56), (30, 100)], "Which picture is taller? " + STORY),
    ([(300, 300)], "Count the dots. " + STORY),
    ([(100, 40), (40, 100)], "Are these the same picture turned? " + STORY),
]
SAME_TEXT = "Tell me what you see, in one line. " + STORY


def messages(sizes: list[tuple[int, int]], text: str, seed: int) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": image_url(w, h, seed + index)}}
             for index, (w, h) in enumerate(sizes)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


async def ask(client: openai.AsyncOpenAI, model: str, chat: list[dict], **extra) -> Answer:
    reply = await client.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"ignore_eos": True, **extra})
    choice = reply.choices[0]
    return Answer(choice.message.content or "", reply.usage.prompt_tokens, reply.usage.completion_tokens,
                  choice.finish_reason)


async def ask_streamed(client: openai.AsyncOpenAI, model: str, chat: list[dict]) -> Answer:
    """The same request streamed: its text pieces joined, the usage of its last chunk."""
    stream = await client.chat.completions.create(model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    pieces, finish_reason, usage = [], "", None
    async for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish_reason = choice.finish_reason or finish_reason
        usage = chunk.usage or usage
    assert usage is not None
    return Answer("".join(pieces), usage.prompt_tokens, usage.completion_tokens, finish_reason)


@pytest.fixture(scope="module")
def model_dir(vision_model_dir: str) -> str:
    return vision_model_dir


@pytest.fixture(scope="module")
def model_name(model_dir: str) -> str:
    return VllmEngineOptions(model_dir=model_dir).model_name


@pytest.fixture(scope="module")
async def vllm_answers(model_dir: str, model_name: str, tmp_path_factory: pytest.TempPathFactory,
                       ) -> tuple[dict[int, Answer], dict[tuple[str, bool], CaseAnswer]]:
    """vLLM's server's answer to each chat (by index; -1 and -2: the same text with image
    seeds 100 and 200; -3: chat 4 with other images, streamed), and to each of the parity
    suite's `IMAGE_CASES`, whole and streamed; the server stopped before this returns."""
    options = VllmEngineOptions(model_dir=model_dir, cpu_threads_bind=str(cores()[0]), kv_cache_gib=0.25)
    answers: dict[int, Answer] = {}
    case_answers: dict[tuple[str, bool], CaseAnswer] = {}
    with vllm_openai_server(options, tmp_path_factory.mktemp("vllm-openai")) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            for index, (sizes, text) in enumerate(CHATS):
                answers[index] = await ask(client, model_name, messages(sizes, text, seed=10 * index))
            answers[-3] = await ask_streamed(client, model_name, messages(*CHATS[4], seed=45))
            answers[-1] = await ask(client, model_name, messages([(64, 64)], SAME_TEXT, seed=100))
            answers[-2] = await ask(client, model_name, messages([(64, 64)], SAME_TEXT, seed=200))
            for case in IMAGE_CASES:
                for stream in STREAMING:
                    case_answers[case.id, stream] = await ask_case(client, case, model_name, stream=stream)
    return answers, case_answers


@pytest.fixture(scope="module")
def references(vllm_answers: tuple[dict[int, Answer], dict[tuple[str, bool], CaseAnswer]]) -> dict[int, Answer]:
    return vllm_answers[0]


def pd_stack(nats_server: EmbeddedNats, model_dir: str, log_dir: Path, *router_args: str) -> Iterator[LocalStack]:
    """The pair, each worker with an encoder-cache store of its own (`encoder_entries`)."""
    prefill, decode = (("--vllm-encoder-cache-dir", str(log_dir / f"encoder-{name}")) for name in ("p1", "d1"))
    yield from pd_pair(nats_server, model_dir, log_dir, decode, prefill_args=prefill, router_args=router_args)


def encoder_entries(stack: LocalStack, worker_id: str) -> int:
    """The encoder outputs `worker_id` stored: one per image its vision encoder ran on."""
    return len(list((Path(stack.config.log_dir) / f"encoder-{worker_id}").rglob(f"*{SUFFIX}")))


async def chats_answer_as_vllms_server(references: dict[int, Answer], stack: LocalStack, client: openai.AsyncOpenAI,
                                       model_name: str, kind: str) -> None:
    """Every chat, and chat 4 with other images streamed (nothing of it cached), answers as
    vLLM's server did, each split with a transfer record of `kind` at the decode worker:
    done, at least one block moved, nothing recomputed."""
    async with observing(stack) as observer:
        split_before = await disaggregated_requests(stack.router_url)
        computed_before = await observer.settled("d1", "computed_prompt_tokens_total")
        prompt_tokens = 0
        for index, (sizes, text) in enumerate(CHATS):
            answer = await ask(client, model_name, messages(sizes, text, seed=10 * index))
            assert answer == references[index], (index, sizes)
            assert answer.prompt_tokens >= BLOCK, "a prompt of at least one whole block: KV to transfer"
            prompt_tokens += answer.prompt_tokens
        assert await ask_streamed(client, model_name, messages(*CHATS[4], seed=45)) == references[-3]
        prompt_tokens += references[-3].prompt_tokens
        assert await disaggregated_requests(stack.router_url) == split_before + len(CHATS) + 1
        await wait_for(lambda: len([r for r in observer.records if r.worker_id == "d1"]) >= len(CHATS) + 1, 10,
                       "a transfer record of every request")
        moved = [(record.kind, record.outcome, record.pulled_tokens, record.recomputed_tokens)
                 for record in observer.records if record.worker_id == "d1"]
        assert len(moved) == len(CHATS) + 1, moved
        unlike = [record for record in moved if record[:2] != (kind, "done") or record[2] < BLOCK or record[3]]
        assert not unlike, (unlike, moved)
        # vLLM's own count: the decode worker computed only what did not arrive: the first
        # token, appended (a push brings the prompt's partial last block too)
        computed = await observer.settled("d1", "computed_prompt_tokens_total") - computed_before
        arrived = sum(record[2] for record in moved)
        assert computed == prompt_tokens + len(moved) - arrived == len(CHATS) + 1, (computed, prompt_tokens, arrived)
        await observer.assert_clean()
    # the pixels reach the decode worker (for blocks that might not arrive), but its vision
    # encoder never ran: every image token's KV arrived; the prefill worker's ran on each image
    assert encoder_entries(stack, "d1") == 0
    images = sum(len(sizes) for sizes, _ in CHATS) + len(CHATS[4][0])  # every chat's, and the streamed one's
    assert encoder_entries(stack, "p1") >= images


class TestPull:
    @pytest.fixture(scope="class")
    @classmethod
    def stack(cls, references: dict[int, Answer], nats_server: EmbeddedNats, model_dir: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
        """Starts only once vLLM's server is gone (it depends on its answers). Its router
        hashes every block the workers announce itself and compares (--verify-kv-hashes)."""
        yield from pd_stack(nats_server, model_dir, tmp_path_factory.mktemp("images-1p1d"), "--verify-kv-hashes")

    async def test_image_chats_answer_as_vllms_server(self, references: dict[int, Answer], stack: LocalStack,
                                                      openai_client, model_name: str) -> None:
        await chats_answer_as_vllms_server(references, stack, openai_client(stack.router_url, timeout=120),
                                           model_name, "pull")

    async def test_another_image_shares_no_kv_and_the_same_image_again_does(
            self, references: dict[int, Answer], stack: LocalStack, openai_client, model_name: str) -> None:
        client = openai_client(stack.router_url, timeout=120)
        first, other = messages([(64, 64)], SAME_TEXT, seed=100), messages([(64, 64)], SAME_TEXT, seed=200)
        async with request_records(stack, "image-records") as records:
            assert await ask(client, model_name, first) == references[-1]
            assert await ask(client, model_name, other) == references[-2]
            assert references[-1].text != references[-2].text  # the image, not only the text, makes the answer
            # the router's index: a new image's blocks are nobody's; the first image's are held
            fresh = messages([(64, 64)], SAME_TEXT, seed=300)
            refused = await ask(client, model_name, fresh, cache_hit_threshold=0.3)
            assert (refused.finish_reason, refused.completion_tokens) == ("cache_threshold", 0)
            assert await ask(client, model_name, first, cache_hit_threshold=0.3) == references[-1]
            await records_arrived(records, 4)
        first_record, other_record, refused_record, again_record = records[:4]
        assert (first_record.cached_tokens, other_record.cached_tokens) == (0, 0)  # no KV of the first image reused
        assert refused_record.finish_reason == "cache_threshold"
        whole_blocks = references[-1].prompt_tokens // BLOCK * BLOCK
        assert again_record.cached_tokens == whole_blocks  # the same image again: its blocks cached

    @pytest.mark.parametrize("stream", STREAMING, ids=("whole", "streamed"))
    @pytest.mark.parametrize("case", IMAGE_CASES, ids=[case.id for case in IMAGE_CASES])
    async def test_the_parity_suites_image_cases(self, case: ParityCase, stream: bool, vllm_answers,
                                                 stack: LocalStack, openai_client, model_name: str) -> None:
        """`parity_cases.IMAGE_CASES`, compared field by field with vLLM's server's answers
        (log-probabilities, usage, streamed chunks' usage, several choices), each split."""
        await assert_answers_like_vllm(case, stream, vllm_answers[1][case.id, stream],
                                       openai_client(stack.router_url, timeout=120), stack.router_url, model_name)
        # these prompts are shorter than a block: their one partial block is pulled, so the
        # decode worker's vision encoder never runs for them either
        assert encoder_entries(stack, "d1") == 0

    async def test_the_routers_own_chain_of_image_blocks_is_the_workers(self, stack: LocalStack) -> None:
        """After the chats above, the router's hashes of every announced block (recomputed
        from the token ids and the image salts the events carry) equal the workers' own."""
        held = await router_samples(stack.router_url, "tandem_router_kv_index_blocks")
        assert sum(value for labels, value in held.items() if 'kind="held"' in labels) > 0, held
        mismatched = await router_samples(stack.router_url, "tandem_router_kv_hash_mismatch_blocks_total")
        assert mismatched and not any(mismatched.values()), mismatched


class TestPush:
    @pytest.fixture(scope="class")
    @classmethod
    def stack(cls, references: dict[int, Answer], nats_server: EmbeddedNats, model_dir: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
        yield from pd_stack(nats_server, model_dir, tmp_path_factory.mktemp("images-1p1d-push"),
                            "--pd-transfer", "push")

    async def test_image_chats_are_pushed(
            self, references: dict[int, Answer], stack: LocalStack, openai_client, model_name: str) -> None:
        """The pushed blocks are cached under hashes that take in the images (the reader's
        commit carries them), so the request finds them, and its partial last block is
        copied in: one prompt token computed each (under hashes of the tokens alone it
        computed its whole prompt)."""
        await chats_answer_as_vllms_server(references, stack, openai_client(stack.router_url, timeout=120),
                                           model_name, "push")
