"""Where a prompt's images go in its tokens, as vLLM's engine will put them. Pure.

A vision-language model's chat template writes one image token (`<image>`) per image; the
engine's processor replaces each by the image's placeholder tokens, as many as its vision
encoder makes embeddings, laid out by the image's size. The router must know them before a
worker runs: they count in `usage`, in the prompt's length limit, and in the block-hash
chain the KV-aware routing matches (`shared.block_hash.image_block_salts`).

`ImageLayout.for_model_dir` reads a model directory's layout; None for a text model. The
family rendered is Idefics3 (`shared.vision_model` generates one): each image becomes a
grid of tiles (as the image processor splits it: the longest edge scaled to `size`, then
tiles of `max_image_size`), each `image_seq_len` image tokens between a marker and its
`<row_r_col_c>` tag, then the whole image scaled down (`<global-img>`). The replacement is
vLLM's `Idefics3ProcessingInfo.get_image_repl` and transformers' `get_number_of_image_patches`,
token by token; tests/vllm/test_vllm_image_chat.py checks it against vLLM's own prompts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

IDEFICS3 = "Idefics3ForConditionalGeneration"
_MAX_IMAGE_SIZE = 4096  # transformers' Idefics3 image processor's absolute bound on a side


class ImagePromptError(ValueError):
    """The images and the prompt's image tokens do not fit together (the caller's 400)."""


@dataclass(frozen=True)
class ImageLayout:
    """How an Idefics3 model lays an image out in tokens."""

    image_token_id: int
    longest_edge: int  # the image processor's `size.longest_edge`: the whole image's scale
    tile_edge: int  # `max_image_size.longest_edge`: a tile's side
    image_seq_len: int  # image tokens per tile
    splits: bool  # `do_image_splitting`
    encode: Callable[[str], list[int]] = field(repr=False, compare=False)  # text -> ids, no special tokens added

    @classmethod
    def for_model_dir(cls, model_dir: str | Path, encode: Callable[[str], list[int]]) -> ImageLayout | None:
        """The layout of `model_dir`'s model; None for a model that takes no images.
        ValueError for a vision-language family this module does not render."""
        path = Path(model_dir)
        config = _json(path / "config.json")
        architectures = config.get("architectures") or []
        if "vision_config" not in config:
            return None
        if IDEFICS3 not in architectures:
            raise ValueError(f"{path}: images are rendered for {IDEFICS3} models only, not {architectures}")
        processor = _json(path / "preprocessor_config.json")
        return cls(image_token_id=int(config["image_token_id"]),
                   longest_edge=int(processor["size"]["longest_edge"]),
                   tile_edge=int(processor["max_image_size"]["longest_edge"]),
                   image_seq_len=int(_json(path / "processor_config.json")["image_seq_len"]),
                   splits=bool(processor.get("do_image_splitting", True)), encode=encode)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """Rows and columns of tiles for an image of `width` x `height` pixels (0, 0: none, the
        whole image only)."""
        if not self.splits:
            return 0, 0
        height, width = _scaled_to(height, width, self.longest_edge)
        height, width = _bounded(height, width, _MAX_IMAGE_SIZE)
        edge = self.tile_edge
        rows, cols = math.ceil(height / edge) * edge, math.ceil(width / edge) * edge
        if rows > edge or cols > edge:
            return math.ceil(rows / edge), math.ceil(cols / edge)
        return 0, 0

    def replacement(self, width: int, height: int) -> list[int]:
        """The tokens one image of this size becomes."""
        tokens = "<image>" * self.image_seq_len
        whole = f"<fake_token_around_image><global-img>{tokens}"
        rows, cols = self.grid(width, height)
        if rows == 0 and cols == 0:
            return self.encode(whole + "<fake_token_around_image>")
        tiles = "".join("".join(f"<fake_token_around_image><row_{row}_col_{col}>{tokens}" for col in range(1, cols + 1))
                        + "\n" for row in range(1, rows + 1))
        return self.encode(f"{tiles}\n{whole}<fake_token_around_image>")

    def expand(self, prompt_ids: Sequence[int], sizes: Sequence[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """`prompt_ids` with each image token replaced by its image's tokens (`sizes`: each
        image's width and height, in order), and each image's `(start, length)` there."""
        places = [index for index, token in enumerate(prompt_ids) if token == self.image_token_id]
        if len(places) != len(sizes):
            raise ImagePromptError(f"the prompt has {len(places)} image placeholders for {len(sizes)} images")
        expanded: list[int] = []
        spans: list[tuple[int, int]] = []
        previous = 0
        for place, (width, height) in zip(places, sizes):
            expanded.extend(prompt_ids[previous:place])
            tokens = self.replacement(width, height)
            spans.append((len(expanded), len(tokens)))
            expanded.extend(tokens)
            previous = place + 1
        expanded.extend(prompt_ids[previous:])
        return expanded, spans


def collapse(token_ids: Sequence[int], spans: Sequence[tuple[int, int]], image_token_id: int) -> list[int]:
    """The prompt as the chat template wrote it: each image's span back to one image token
    (what vLLM's processor expands again)."""
    collapsed: list[int] = []
    previous = 0
    for start, length in spans:
        collapsed.extend(token_ids[previous:start])
        collapsed.append(image_token_id)
        previous = start + length
    collapsed.extend(token_ids[previous:])
    return collapsed


def _scaled_to(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest edge to `longest`, the other by the aspect ratio, rounded up to even."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    return max(height, 1), max(width, 1)


def _bounded(height: int, width: int, bound: int) -> tuple[int, int]:
    ratio = width / height
    if width >= height and width > bound:
        width, height = bound, int(bound / ratio)
    elif height > width and height > bound:
        height, width = bound, int(bound * ratio)
    return max(height, 1), max(width, 1)


def _json(path: Path) -> dict:
    with path.open(encoding="utf-8") as handle:
        loaded = json.load(handle)
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return loaded
