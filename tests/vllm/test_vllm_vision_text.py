"""The generated vision-language model (`tandem model vision`, an Idefics3) behind the router,
on one real vLLM (CPU) worker, asked text only: a chat and a completion answer the greedy
text vLLM's offline `LLM.chat` / `LLM.generate` answers, with as many prompt tokens.

The router reads the text model's limits from the config's `text_config`
(`shared.model_config`) and renders the chat as vLLM does: Idefics3's template loops over
content parts, so each message's text goes in as one text part (`shared.chat_content`). An
image part is still refused. The offline engine answers first and stops before the stack
starts (one engine at a time, on the same core, with the worker's settings).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")
psutil = pytest.importorskip("psutil")

from vllm import LLM, SamplingParams  # noqa: E402

from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from tests.stack_fixtures import running  # noqa: E402
from tests.vllm.conftest import cores, vllm_args, vllm_stack  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
CHAT = [{"role": "system", "content": "Answer in one short line."},
        {"role": "user", "content": [{"type": "text", "text": "What does the ferryman count "},
                                     {"type": "text", "text": "under the old stone bridge?"}]}]
PROMPT = "The river runs past the mill and the ferryman counts his coins"


@dataclass
class Answer:
    text: str
    prompt_tokens: int


@dataclass
class References:
    chat: Answer
    completion: Answer


@pytest.fixture(scope="module")
def model_dir(vision_model_dir: str) -> str:
    return vision_model_dir


@pytest.fixture(scope="module")
def references(model_dir: str) -> References:
    """vLLM's own answers (the worker's engine settings: model dtype, seed 0, its lengths and
    batch), the offline engine stopped before the stack starts."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cores()[0]))
        engine = LLM(model=model_dir, dtype="auto", seed=0, max_model_len=2048, max_num_seqs=64,
                     max_num_batched_tokens=512, enforce_eager=True, enable_prefix_caching=True,
                     kv_cache_memory_bytes=256 << 20)
    engine_processes = [child for child in psutil.Process().children(recursive=True) if child.name().startswith("VLLM")]
    try:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        [chat] = engine.chat(CHAT, greedy, use_tqdm=False)
        [completion] = engine.generate([PROMPT], greedy, use_tqdm=False)
    finally:
        engine.llm_engine.engine_core.shutdown()
        _, alive = psutil.wait_procs(engine_processes, timeout=30)
    assert not alive, f"vLLM processes left behind: {alive}"
    return References(Answer(chat.outputs[0].text, len(chat.prompt_token_ids)),
                      Answer(completion.outputs[0].text, len(completion.prompt_token_ids)))


@pytest.fixture(scope="module")
def stack(nats_server: EmbeddedNats, model_dir: str, references: References,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    specs = (WorkerSpec(worker_id="v1", role=WorkerRole.BOTH, extra_args=vllm_args(0)),)
    with running(vllm_stack(nats_server, model_dir, tmp_path_factory.mktemp("vllm-vision"), specs)) as stack:
        yield stack


async def test_a_text_chat_answers_as_vllm_chats(stack: LocalStack, references: References, openai_client) -> None:
    client = openai_client(stack.router_url, timeout=120)
    reply = await client.chat.completions.create(model="vision", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert Answer(reply.choices[0].message.content, reply.usage.prompt_tokens) == references.chat


async def test_a_completion_answers_as_vllm_generates(stack: LocalStack, references: References,
                                                      openai_client) -> None:
    client = openai_client(stack.router_url, timeout=120)
    reply = await client.completions.create(model="vision", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert Answer(reply.choices[0].text, reply.usage.prompt_tokens) == references.completion


async def test_an_image_part_is_still_refused(stack: LocalStack, openai_client) -> None:
    client = openai_client(stack.router_url, timeout=120)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="vision", max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
