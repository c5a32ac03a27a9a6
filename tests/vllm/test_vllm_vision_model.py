"""The generated vision-language model (`tandem model vision`, an Idefics3) on vLLM's CPU build:
chats with an image as a data URL, through vLLM's offline `LLM.chat`.

An image expands into its tiles' placeholder tokens; the same chat answers the same
greedy text and finds its prefix cached; the same text with another image gives the same
prompt tokens but another answer, and shares no cached block with the first (vLLM puts
each image's content hash into the hash of the blocks its tokens are in). One engine for
the module, on one core (start-up ~60 s on a busy 2-core host).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")
psutil = pytest.importorskip("psutil")

from PIL import Image  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from shared.vision_model import IDEFICS3_TOKENS, IMAGE_SEQ_LEN  # noqa: E402
from tests.vllm.conftest import BLOCK, cores  # noqa: E402

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Long enough that the prompt fills a whole block (the image's tokens are in the first).
LONG_TEXT = ("Under the old stone bridge the water turns green and slow, and the ferryman counts his coins "
             "one by one while the fog comes down the valley and the lamps of the mill go out. ") * 4


@pytest.fixture(scope="module")
def llm(vision_model_dir: str) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", str(cores()[0]))
        engine = LLM(model=vision_model_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=4,
                     max_num_batched_tokens=1024, enforce_eager=True, kv_cache_memory_bytes=256 << 20,
                     limit_mm_per_prompt={"image": 2}, seed=0)
    # EngineCore and its model worker (named by setproctitle), not multiprocessing's resource tracker
    engine_processes = [child for child in psutil.Process().children(recursive=True) if child.name().startswith("VLLM")]
    assert engine_processes
    try:
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        _, alive = psutil.wait_procs(engine_processes, timeout=30)
        assert not alive, f"vLLM processes left behind: {alive}"


def image_url(seed: int) -> str:
    """A 64x64 PNG of random pixels as a data URL."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def chat(llm: LLM, image_seed: int, text: str):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(image_seed)}},
                                             {"type": "text", "text": text}]}]
    [output] = llm.chat(messages, GREEDY, use_tqdm=False)
    return output


def test_an_image_expands_into_its_tiles_placeholders(llm: LLM) -> None:
    output = chat(llm, 0, "What is in the picture?")
    tokenizer = llm.get_tokenizer()
    image, fake, global_image = (tokenizer.convert_tokens_to_ids(token)
                                 for token in ("<image>", "<fake_token_around_image>", "<global-img>"))
    prompt = output.prompt_token_ids
    # 64x64 pixels: resized to 112x112, split into 2x2 tiles of 56, plus the whole image at 56.
    assert prompt.count(image) == 5 * IMAGE_SEQ_LEN
    assert prompt.count(global_image) == 1 and prompt.count(fake) == 6
    assert [tokenizer.convert_tokens_to_ids(f"<row_{row}_col_{col}>") in prompt
            for row, col in ((1, 1), (1, 2), (2, 1), (2, 2), (1, 3))] == [True] * 4 + [False]
    assert prompt[0] == tokenizer.convert_tokens_to_ids(IDEFICS3_TOKENS[0])  # <|begin_of_text|>, by the template
    assert len(output.outputs[0].token_ids) == GREEDY.max_tokens


def test_the_same_chat_answers_the_same_from_its_cached_prefix(llm: LLM) -> None:
    first = chat(llm, 1, "The same picture again. " + LONG_TEXT)
    again = chat(llm, 1, "The same picture again. " + LONG_TEXT)
    assert len(first.prompt_token_ids) > BLOCK
    assert again.prompt_token_ids == first.prompt_token_ids
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].text == first.outputs[0].text
    whole_blocks = (len(first.prompt_token_ids) - 1) // BLOCK * BLOCK  # the last token is always computed
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, whole_blocks)


def test_another_image_with_the_same_text_shares_no_block_and_answers_otherwise(llm: LLM) -> None:
    first = chat(llm, 2, "Another picture. " + LONG_TEXT)
    other = chat(llm, 3, "Another picture. " + LONG_TEXT)
    assert other.prompt_token_ids == first.prompt_token_ids  # the placeholders do not name the image
    assert other.num_cached_tokens == 0  # the first block's hash holds the image's content hash
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
