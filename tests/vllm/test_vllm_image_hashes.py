"""A push's reader caches the written blocks under hashes that take in the prompt's images
(`connector.vllm.image_hashes`): a control request, tokens alone, is hashed again with the
images' identifiers and places and then hashes its blocks exactly as vLLM hashes the
request itself (a real vLLM `Request` with its multimodal features and vLLM's own block
hasher), where the tokens alone hash them otherwise."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv (make install-vllm)")

from vllm import SamplingParams  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from connector.vllm.image_hashes import hash_with_images  # noqa: E402
from connector.vllm.kv_wire import CommitOrder, ImagePlace, control_of, control_params  # noqa: E402

BLOCK = 16
PROMPT = list(range(100, 180))  # 5 whole blocks
IMAGES = [ImagePlace("sha256:one", 5, 20), ImagePlace("sha256:two", 40, 12)]


def request(mm_features: list[MultiModalFeatureSpec] | None = None) -> Request:
    init_none_hash(sha256)
    return Request("r", list(PROMPT), SamplingParams(max_tokens=1), None, mm_features=mm_features,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def as_vllm_processed() -> Request:
    """The request as vLLM's input processor makes it: features with data and embedding masks."""
    return request([MultiModalFeatureSpec(data=None, modality="image", identifier=image.identifier,
                                          mm_position=PlaceholderRange(offset=image.offset, length=image.length,
                                                                       is_embed=None),
                                          mm_hash=image.identifier) for image in IMAGES])


def test_a_control_request_hashed_with_the_images_hashes_as_the_request() -> None:
    control = request()
    tokens_alone = list(control.block_hashes)
    hash_with_images(control, list(reversed(IMAGES)))  # any order: features go in prompt order
    expected = as_vllm_processed().block_hashes
    assert len(expected) == len(PROMPT) // BLOCK
    assert control.block_hashes == expected
    # blocks 0-3 hold an image, and block 4 is chained to them: every hash differs
    assert all(ours != theirs for ours, theirs in zip(tokens_alone, expected, strict=True))


def test_without_images_the_hashes_stay() -> None:
    control = request()
    before = list(control.block_hashes)
    hash_with_images(control, [])
    assert control.block_hashes == before
    assert not control.mm_features


def test_a_commit_order_carries_its_images_through_the_control_params() -> None:
    order = CommitOrder(key="k", count=2, images=IMAGES)
    assert control_of(control_params(order)) == order
    assert control_of(control_params(CommitOrder(key="k", count=2))).images == []
