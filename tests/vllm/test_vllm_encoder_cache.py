"""Tandem's encoder-cache connector (`connector.vllm.encoder_cache`) on vLLM's CPU build with
the generated vision-language model: one engine stores the vision encoder's output for an
image, a second engine (another worker, which never saw the image) answers the same chat
from the stored output, not from its own encoder.

The proof that the second engine loads rather than encodes: the stored output of one image
is replaced by zeros before the second engine meets it, and its answer changes; for an image
left alone, its answer equals the first engine's. The same holds through the whole stack:
two workers given one `--vllm-encoder-cache-dir`, each chat pinned by the router to one of
them. There, too, a prompt with an image that one worker computed is pulled by the other
(its whole blocks, the image's tokens among them), which answers alike.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from connector.encoder_store import SUFFIX, EncoderStore  # noqa: E402
from connector.vllm import encoder_cache  # noqa: E402
from connector.vllm.settings import EncoderCacheSettings  # noqa: E402
from launch.plan import WorkerSpec  # noqa: E402
from launch.stack import LocalStack  # noqa: E402
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from tests.stack_fixtures import observing, running  # noqa: E402
from tests.vllm.conftest import BLOCK, cores, vllm_args, vllm_stack  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXT = "What is in this picture?"
PAIR = ("w1", "w2")


def image_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(llm: LLM, image_seed: int) -> list[int]:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(image_seed)},
                                              "uuid": f"image-{image_seed}"},
                                             {"type": "text", "text": TEXT}]}]
    [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def engine(model_dir: str, settings: EncoderCacheSettings) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cores()[0]))
        llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=4,
                  max_num_batched_tokens=1024, enforce_eager=True, kv_cache_memory_bytes=128 << 20,
                  limit_mm_per_prompt={"image": 1}, seed=0,
                  ec_transfer_config=encoder_cache.transfer_config(settings))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_a_second_engine_answers_from_the_first_ones_stored_encoder_output(vision_model_dir: str,
                                                                          tmp_path: Path) -> None:
    settings = EncoderCacheSettings(root=str(tmp_path), namespace="vision@", budget_bytes=64 << 20)
    store = EncoderStore(settings.root, settings.namespace, budget_bytes=settings.budget_bytes)
    first = engine(vision_model_dir, settings)
    llm = next(first)
    answers = {seed: chat(llm, seed) for seed in (1, 2)}
    first.close()
    assert answers[1] != answers[2]
    assert store.has("image-1") and store.has("image-2")

    stored = safetensors.torch.load_file(store.path("image-2"))[encoder_cache.TENSOR]
    safetensors.torch.save_file({encoder_cache.TENSOR: torch.zeros_like(stored)}, str(store.path("image-2")))

    second = engine(vision_model_dir, settings)
    llm = next(second)
    try:
        assert chat(llm, 1) == answers[1]  # the stored output is the encoder's own
        assert chat(llm, 2) != answers[2]  # the zeros were loaded: the second engine did not encode
    finally:
        second.close()


def test_a_worker_with_an_encoder_cache_dir_starts_vllm_with_tandems_connector(vision_model_dir: str,
                                                                              tmp_path: Path) -> None:
    from services.worker.vllm.config import VllmEngineConfig
    from services.worker.vllm.engine_config import engine_args
    from services.worker.vllm.kv_events import KvEventEndpoints
    from services.worker.vllm.options import VllmEngineOptions
    from shared.config import WorkerConfig

    config = WorkerConfig(worker_id="w", engine="vllm", model_dir=vision_model_dir)
    endpoints = KvEventEndpoints(publish="tcp://127.0.0.1:5555", replay="tcp://127.0.0.1:5556")
    options = VllmEngineOptions.from_worker_config(config, VllmEngineConfig(encoder_cache_dir=str(tmp_path)))
    args = engine_args(options, endpoints, None)
    assert args.ec_transfer_config is not None
    assert (args.ec_transfer_config.ec_connector, args.ec_transfer_config.ec_connector_module_path,
            args.ec_transfer_config.ec_role) == ("TandemEncoderCache", "connector.vllm.encoder_cache", "ec_both")
    assert args.ec_transfer_config.ec_connector_extra_config["root"] == str(tmp_path)
    assert engine_args(VllmEngineOptions.from_worker_config(config), endpoints, None).ec_transfer_config is None


STORY = ("Under the old stone bridge the water turns green and slow, and the ferryman counts his coins one by one "
         "while the fog comes down the valley and the lamps of the mill go out. ") * 4


@pytest.fixture(scope="module")
def pinned_pair(nats_server: EmbeddedNats, vision_model_dir: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalStack, Path]]:
    """Two workers of role both given one `--vllm-encoder-cache-dir`, and a router that sends
    each chat to the worker its `X-Tandem-Worker` header names (prefix pulls on); the stack
    and the store's directory."""
    scratch = tmp_path_factory.mktemp("encoder-pair")
    store_dir = scratch / "encoder-store"
    specs = tuple(WorkerSpec(worker_id=worker_id, role=WorkerRole.BOTH,
                             extra_args=vllm_args(index, "--vllm-encoder-cache-dir", str(store_dir)))
                  for index, worker_id in enumerate(PAIR))
    with running(vllm_stack(nats_server, vision_model_dir, scratch / "logs", specs,
                            router_args=("--routing-policy", "pinned"))) as stack:
        yield stack, store_dir


async def ask_worker(client: openai.AsyncOpenAI, model_dir: str, worker_id: str, image_seed: int,
                     text: str = TEXT) -> tuple[str, int]:
    """The greedy answer of `worker_id` to an image (first) and `text`, and the prompt's tokens."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(image_seed)}},
                                             {"type": "text", "text": text}]}]
    reply = await client.chat.completions.create(
        model=Path(model_dir).name, messages=messages, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={"X-Tandem-Worker": worker_id})
    return reply.choices[0].message.content or "", reply.usage.prompt_tokens


@pytest.mark.e2e
async def test_through_the_router_a_turn_moved_to_another_worker_loads_the_image_it_met_first(
        pinned_pair: tuple[LocalStack, Path], vision_model_dir: str, openai_client) -> None:
    """An image w1 answered first is answered alike by w2 from w1's stored encoder output;
    where that output is replaced by zeros before w2 meets the image, w2's answer changes:
    it loaded, it did not encode. The prompts are shorter than a block: w2 has nothing of
    w1's KV to pull, so it must encode the image or load its output."""
    stack, store_dir = pinned_pair
    client = openai_client(stack.router_url, timeout=120)
    kept, prompt_tokens = await ask_worker(client, vision_model_dir, "w1", 1)
    assert prompt_tokens < BLOCK
    before = set(store_dir.rglob(f"*{SUFFIX}"))
    assert (await ask_worker(client, vision_model_dir, "w2", 1))[0] == kept  # loaded from w1's entry
    assert set(store_dir.rglob(f"*{SUFFIX}")) == before  # w2 stored nothing new

    zeroed, _ = await ask_worker(client, vision_model_dir, "w1", 2)
    [entry] = sorted(set(store_dir.rglob(f"*{SUFFIX}")) - before)
    stored = safetensors.torch.load_file(str(entry))[encoder_cache.TENSOR]
    safetensors.torch.save_file({encoder_cache.TENSOR: torch.zeros_like(stored)}, str(entry))
    assert (await ask_worker(client, vision_model_dir, "w2", 2))[0] != zeroed  # w2 loaded the zeros


@pytest.mark.e2e
async def test_an_image_prompts_kv_pulled_by_another_worker_answers_as_its_holder_did(
        pinned_pair: tuple[LocalStack, Path], vision_model_dir: str, openai_client) -> None:
    """A prompt of an image and a long text that w1 computed, sent to w2: w2 pulls the
    prompt's whole blocks from w1 (the image's tokens among them) and computes only the
    tail, and answers as w1 did."""
    stack, _ = pinned_pair
    client = openai_client(stack.router_url, timeout=120)
    async with observing(stack, PAIR, "encoder-pair-observer") as observer:
        held, prompt_tokens = await ask_worker(client, vision_model_dir, "w1", 3, text=STORY)
        assert prompt_tokens >= 2 * BLOCK
        records_before = len(observer.records)
        assert (await ask_worker(client, vision_model_dir, "w2", 3, text=STORY))[0] == held
        await wait_for(lambda: any(r.kind == "prefix_pull" for r in observer.records[records_before:]), 10,
                       "the prefix pull's record")
        pulls = [(r.worker_id, r.peer_worker_id, r.outcome, r.pulled_tokens)
                 for r in observer.records[records_before:] if r.kind == "prefix_pull"]
        assert pulls == [("w2", "w1", "done", (prompt_tokens - 1) // BLOCK * BLOCK)], pulls  # the last token computed
        await observer.assert_clean()
