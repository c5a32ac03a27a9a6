"""Where a chat's images go in its prompt (`shared.image_placeholders`) and in its block-hash
chain (`shared.block_hash.request_chain`), on the generated Idefics3.

The placeholder counts are vLLM 0.32's own, read from the prompts its engine made for these
image sizes on this model (tests/vllm/test_vllm_image_chat.py checks whole prompts against it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.block_hash import block_hash_chain, image_block_salts, image_key, request_chain
from shared.image_placeholders import ImageLayout, ImagePromptError, collapse
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer
from shared.vision_model import IMAGE_SEQ_LEN


@pytest.fixture(scope="module")
def tokenizer(vision_model_dir: str) -> Tokenizer:
    return Tokenizer.from_model_dir(vision_model_dir)


@pytest.fixture(scope="module")
def layout(tokenizer: Tokenizer) -> ImageLayout:
    assert tokenizer.image_layout is not None
    return tokenizer.image_layout


# width, height -> placeholder tokens vLLM's engine made for one image
VLLM_COUNTS = {(64, 64): 34, (30, 100): 22, (200, 50): 21, (56, 56): 34, (20, 20): 34, (57, 20): 21,
               (113, 300): 22, (1, 1): 34, (5000, 100): 21}


@pytest.mark.parametrize(("size", "count"), VLLM_COUNTS.items())
def test_an_image_becomes_as_many_tokens_as_vllm_makes_of_it(layout: ImageLayout, size: tuple[int, int],
                                                             count: int) -> None:
    assert len(layout.replacement(*size)) == count


def test_a_square_image_is_a_grid_of_tiles_then_the_whole_image(layout: ImageLayout, tokenizer: Tokenizer) -> None:
    assert layout.grid(64, 64) == (2, 2)
    tokens = layout.replacement(64, 64)
    assert tokens.count(layout.image_token_id) == 5 * IMAGE_SEQ_LEN
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.startswith("<fake_token_around_image><row_1_col_1>" + "<image>" * IMAGE_SEQ_LEN)
    assert "<row_2_col_2>" in text and text.endswith("<global-img>" + "<image>" * IMAGE_SEQ_LEN
                                                     + "<fake_token_around_image>")
    assert layout.grid(200, 50) == (1, 2) and layout.grid(30, 100) == (2, 1)


def test_expand_places_each_image_and_collapse_undoes_it(layout: ImageLayout) -> None:
    image = layout.image_token_id
    prompt = [1, 2, image, 3, image, 4]
    expanded, spans = layout.expand(prompt, [(64, 64), (200, 50)])
    assert spans == [(2, 34), (2 + 34 + 1, 21)]
    assert expanded[:2] == [1, 2] and expanded[36] == 3 and expanded[-1] == 4 and len(expanded) == 4 + 34 + 21
    assert collapse(expanded, spans, image) == prompt


def test_images_and_image_tokens_must_pair(layout: ImageLayout) -> None:
    with pytest.raises(ImagePromptError, match="2 image placeholders for 1 images"):
        layout.expand([layout.image_token_id] * 2, [(64, 64)])


def test_a_text_model_has_no_image_layout(tmp_path: Path) -> None:
    generate_tiny_model(str(tmp_path / "tiny"))
    tokenizer = Tokenizer.from_model_dir(str(tmp_path / "tiny"))
    assert tokenizer.image_layout is None and "takes no images" in tokenizer.images_refused


# ---- the block-hash chain -------------------------------------------------------------


def test_without_images_the_chain_is_the_plain_chain() -> None:
    tokens = list(range(100))
    assert request_chain(tokens, 16) == block_hash_chain(tokens, 16)


def test_an_image_salts_the_blocks_its_tokens_are_in_at_its_offset() -> None:
    salts = image_block_salts([("a", 20, 30), ("b", 50, 4)], 16, 5)
    assert salts == [b"", image_key("a", 4), image_key("a", -12), image_key("a", -28) + image_key("b", 2), b""]


def test_another_image_changes_the_chain_from_its_first_block_on() -> None:
    tokens = list(range(128))
    first = request_chain(tokens, 16, images=[("sha256:a", 40, 34)])
    other = request_chain(tokens, 16, images=[("sha256:b", 40, 34)])
    again = request_chain(tokens, 16, images=[("sha256:a", 40, 34)])
    assert first == again
    assert first[:2] == other[:2] == block_hash_chain(tokens, 16)[:2]  # the blocks before the image stay shared
    assert all(a != b for a, b in zip(first[2:], other[2:]))
    moved = request_chain(tokens, 16, images=[("sha256:a", 41, 34)])  # the same image one token later
    assert moved[2] != first[2]
