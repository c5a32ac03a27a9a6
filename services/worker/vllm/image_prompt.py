"""A request with images as vLLM's engine takes it, and the check that vLLM placed them where
the router did.

The router sends the prompt with each image's placeholder tokens already in it (it needs
them to count, route and hash: `shared.image_placeholders`). vLLM's processor expands an
image's one token itself, so `engine_prompt` collapses each image's span back to that token
and hands vLLM the pictures, decoded as vLLM's server decodes a data URL
(`ImageMediaIO`, RGB), and the images' identifiers as their `multi_modal_uuids`: vLLM's
processor cache and prefix-cache hashes then key on the same identifier as Tandem's chain,
and its KV events name it (`kv_event_wire`). `check_placement` compares vLLM's expanded
prompt with the router's: a difference is refused, never served with other KV.

Caller: `engine.VllmEngine`, building a request's engine input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.multimodal.media.image import ImageMediaIO

from shared.errors import InvalidArgument
from shared.image_placeholders import collapse
from shared.schemas.generate import ImageInput


def engine_prompt(token_ids: list[int], images: Sequence[ImageInput], image_token_id: int | None,
                  cache_salt: str = "") -> dict[str, Any]:
    """vLLM's prompt dict for `token_ids` and their `images`, with the request's `cache_salt`."""
    salted = {"cache_salt": cache_salt} if cache_salt else {}
    if not images:
        return {"prompt_token_ids": token_ids, **salted}
    if image_token_id is None:
        raise InvalidArgument("this worker's model takes no images")
    if any(not image.data for image in images):
        raise InvalidArgument("an image of the request came without its data")
    loader = ImageMediaIO(image_mode="RGB")
    try:
        pictures = [loader.load_bytes(image.data) for image in images]
    except Exception as error:  # the router checked them: a corrupt one here came another way
        raise InvalidArgument(f"an image of the request cannot be read: {error}") from None
    return {"prompt_token_ids": collapse(token_ids, [(image.start, image.length) for image in images], image_token_id),
            "multi_modal_data": {"image": pictures},
            "multi_modal_uuids": {"image": [image.identifier for image in images]}, **salted}


def check_placement(engine_input: Any, token_ids: list[int]) -> None:
    """vLLM's prompt (images expanded by its processor) is the router's, token for token."""
    placed = engine_input.get("prompt_token_ids") if isinstance(engine_input, dict) else None
    if placed is not None and list(placed) != token_ids:
        first = next((index for index, (a, b) in enumerate(zip(placed, token_ids)) if a != b),
                     min(len(placed), len(token_ids)))
        raise InvalidArgument(f"the engine placed the prompt's images otherwise than the router: {len(placed)} "
                              f"tokens against {len(token_ids)}, first different at {first}")
