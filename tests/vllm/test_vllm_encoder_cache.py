"""Tandem's encoder-cache connector (`connector.vllm.encoder_cache`) on vLLM's CPU build with
the generated vision-language model: one engine stores the vision encoder's output for an
image, a second engine (another worker, which never saw the image) answers the same chat
from the stored output, not from its own encoder.

The proof that the second engine loads rather than encodes: the stored output of one image
is replaced by zeros before the second engine meets it, and its answer changes; for an image
left alone, its answer equals the first engine's. The same holds through the whole stack:
two workers given one `--vllm-encoder-cache-dir`, each chat pinned by the router to one of
them.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
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
from shared.nats_server import EmbeddedNats  # noqa: E402
from shared.schemas import WorkerRole  # noqa: E402
from tests.stack_fixtures import running  # noqa: E402
from tests.vllm.conftest import cores, vllm_args, vllm_stack  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXT = "What is in this picture?"


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
    from services.worker.vllm.engine_config import engine_args
    from services.worker.vllm.kv_events import KvEventEndpoints
    from services.worker.vllm.options import VllmEngineOptions
    from shared.config import WorkerConfig

    config = WorkerConfig(worker_id="w", engine="vllm", model_dir=vision_model_dir,
                          vllm_encoder_cache_dir=str(tmp_path))
    endpoints = KvEventEndpoints(publish="tcp://127.0.0.1:5555", replay="tcp://127.0.0.1:5556")
    args = engine_args(VllmEngineOptions.from_worker_config(config), endpoints, None)
    assert args.ec_transfer_config is not None
    assert (args.ec_transfer_config.ec_connector, args.ec_transfer_config.ec_connector_module_path,
            args.ec_transfer_config.ec_role) == ("TandemEncoderCache", "connector.vllm.encoder_cache", "ec_both")
    assert args.ec_transfer_config.ec_connector_extra_config["root"] == str(tmp_path)
    plain = WorkerConfig(worker_id="w", engine="vllm", model_dir=vision_model_dir)
    assert engine_args(VllmEngineOptions.from_worker_config(plain), endpoints, None).ec_transfer_config is None


@pytest.mark.e2e
async def test_through_the_router_a_turn_moved_to_another_worker_loads_the_image_it_met_first(
        nats_server: EmbeddedNats, vision_model_dir: str, tmp_path: Path, openai_client) -> None:
    """Two workers started with one `--vllm-encoder-cache-dir`, the router pinning each chat
    to the worker its header names (no prefix pulls: the second worker has none of the first
    one's KV). An image w1 answered first is answered alike by w2 from w1's stored encoder
    output; where that output is replaced by zeros before w2 meets the image, w2's answer
    changes: it loaded, it did not encode."""
    store_dir = tmp_path / "encoder-store"
    specs = tuple(WorkerSpec(worker_id=worker_id, role=WorkerRole.BOTH,
                             extra_args=vllm_args(index, "--vllm-encoder-cache-dir", str(store_dir)))
                  for index, worker_id in enumerate(("w1", "w2")))
    router_args = ("--routing-policy", "pinned", "--no-prefix-pull")
    with running(vllm_stack(nats_server, vision_model_dir, tmp_path / "logs", specs, router_args=router_args)) as stack:
        client = openai_client(stack.router_url, timeout=120)

        async def answer(worker_id: str, image_seed: int) -> str:
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(image_seed)}},
                                                     {"type": "text", "text": TEXT}]}]
            reply = await client.chat.completions.create(
                model=Path(vision_model_dir).name, messages=messages, max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"X-Tandem-Worker": worker_id})
            return reply.choices[0].message.content or ""

        kept = await answer("w1", 1)
        assert await answer("w2", 1) == kept  # loaded from w1's entry: the same answer
        entries = sorted(store_dir.rglob(f"*{SUFFIX}"))
        assert len(entries) == 1, entries  # one image, stored once (w2 stored nothing new)

        zeroed = await answer("w1", 2)
        [entry] = sorted(set(store_dir.rglob(f"*{SUFFIX}")) - set(entries))
        stored = safetensors.torch.load_file(str(entry))[encoder_cache.TENSOR]
        safetensors.torch.save_file({encoder_cache.TENSOR: torch.zeros_like(stored)}, str(entry))
        assert await answer("w2", 2) != zeroed  # w2 loaded the zeros: it did not encode the image
