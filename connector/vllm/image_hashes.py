"""A push reader's control request hashed as the request it stands for will be: with the
prompt's images.

vLLM hashes a block from its tokens and from the images in it (an extra key of the image's
identifier and its offset in the block). A control request carries tokens only, so the
blocks a push wrote, cached under its hashes, were never found by the request itself where
its prompt holds an image: the decode worker computed the whole prompt again. `hash_with_images`
gives the control request the images' features (identifier and place; no pixels: it is never
scheduled) and hashes its blocks again, as vLLM's input processor and `Request` would for the
request (`multi_modal_uuids` make the identifier Tandem's own).

Caller: `connector_scheduler.SchedulerSide._commit`, on vLLM's engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from connector.vllm.kv_wire import ImagePlace

if TYPE_CHECKING:
    from vllm.v1.request import Request


def image_features(images: Sequence[ImagePlace]) -> list[MultiModalFeatureSpec]:
    """vLLM's features of `images`, in prompt order, without their data."""
    return [MultiModalFeatureSpec(data=None, modality="image", identifier=image.identifier,
                                  mm_position=PlaceholderRange(offset=image.offset, length=image.length),
                                  mm_hash=image.identifier)
            for image in sorted(images, key=lambda image: image.offset)]


def hash_with_images(request: Request, images: Sequence[ImagePlace]) -> None:
    """Hash `request`'s full blocks again, taking `images` in (nothing to do without any)."""
    if not images:
        return
    request.mm_features = image_features(images)
    request.block_hashes = []
    request.update_block_hashes()
