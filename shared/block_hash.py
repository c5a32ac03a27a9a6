"""Tandem's block-hash chain, computed from token ids alone.

hash(block i) = xxh3_64(hash(block i-1) as LE64 || salt || token ids of block i as LE u32).
Two workers with the same block size agree on every hash of a shared prefix, whatever
engine they run; routers compute the same chain from tokenized requests and from the
token ids in KV events. Only full blocks are hashed: a partial tail block is never shared.
xxh3 rather than a cryptographic hash: this runs for every block a router indexes, and
keys only a cache (a collision costs a recompute-free wrong match on one prefix, at 2^-64).

A request served with a LoRA adapter computes other KV for the same tokens, so its chain
starts from the adapter's root (`adapter_root`) instead of `ROOT_PARENT`: no block of one
adapter, or of the base model, ever has the hash of another's. Without an adapter the root
is `ROOT_PARENT`, so the chains of plain requests are what they always were.

A request with vLLM's `cache_salt` starts from a root that hashes the salt with the adapter's
root (`chain_root`): its blocks match only requests with the same salt, so a tenant cannot
learn from cache hits what another's prompts were.

A prompt that holds images (a vision-language model's) has each image's placeholder tokens
in it, the same ids for any image: the blocks an image's tokens are in also hash the image's
identifier and where it starts relative to the block (`image_block_salts`), as vLLM's own
prefix cache hashes `("mm", identifier, offset)`, so equal text with another image never
matches, the same image again does, and blocks before the first image stay shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from xxhash import xxh3_64_intdigest

from shared.token_pack import TOKEN_BYTES, pack_token_ids

ROOT_PARENT = 0
_IMAGE_KEY = b"mm"
_ADAPTER_DOMAIN = b"tandem-lora-adapter:"
_SALT_DOMAIN = b"tandem-cache-salt:"


def adapter_root(adapter: str) -> int:
    """The parent of a request's first block: `ROOT_PARENT` for the base model (adapter ""),
    else a hash of the adapter's name (never `ROOT_PARENT`)."""
    if not adapter:
        return ROOT_PARENT
    return xxh3_64_intdigest(_ADAPTER_DOMAIN + adapter.encode()) or 1


def chain_root(adapter: str = "", cache_salt: str = "") -> int:
    """The parent of a request's first block: its adapter's root (`adapter_root`) without a
    cache salt, else a hash of that root and the salt (never `ROOT_PARENT`)."""
    root = adapter_root(adapter)
    if not cache_salt:
        return root
    return xxh3_64_intdigest(_SALT_DOMAIN + root.to_bytes(8, "little") + cache_salt.encode()) or 1


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: bytes = b"") -> int:
    return xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + salt + pack_token_ids(token_ids))


def block_hash_chain(token_ids: Sequence[int], block_size: int, *, parent_hash: int = ROOT_PARENT,
                     salt: bytes = b"") -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash` (tokens packed once)."""
    return packed_block_hash_chain(pack_token_ids(token_ids), block_size, parent_hash=parent_hash, salt=salt)


def packed_block_hash_chain(data: bytes, block_size: int, *, parent_hash: int = ROOT_PARENT,
                            salt: bytes = b"", block_salts: Sequence[bytes] = ()) -> list[int]:
    """`block_hash_chain` of token ids packed as `shared.token_pack` packs them; block i's
    salt is `salt` followed by `block_salts[i]` where given (`image_block_salts`)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    step = block_size * TOKEN_BYTES
    hashes: list[int] = []
    if block_salts:
        for start, extra in zip(range(0, len(data) - step + 1, step), block_salts):
            parent_hash = xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + salt + extra + data[start:start + step])
            hashes.append(parent_hash)
        return hashes
    for start in range(0, len(data) - step + 1, step):
        parent_hash = xxh3_64_intdigest(parent_hash.to_bytes(8, "little") + salt + data[start:start + step])
        hashes.append(parent_hash)
    return hashes


def image_key(identifier: str, offset: int) -> bytes:
    """One image's part of a block's salt: its identifier and where it starts relative to the
    block's first token (negative for an image that began in an earlier block)."""
    return _IMAGE_KEY + identifier.encode() + offset.to_bytes(8, "little", signed=True)


def image_block_salts(spans: Iterable[tuple[str, int, int]], block_size: int, blocks: int) -> list[bytes]:
    """Each of the first `blocks` blocks' salt from the images whose placeholder tokens
    (`(identifier, start, length)`, in prompt order) overlap it: the `image_key`s of those
    images, in order; b"" for a block without image tokens. vLLM's `_gen_mm_extra_hash_keys`
    gives a block the same images at the same offsets."""
    salts = [b""] * blocks
    for identifier, start, length in spans:
        first, last = start // block_size, (start + length - 1) // block_size
        for block in range(first, min(last + 1, blocks)):
            salts[block] += image_key(identifier, start - block * block_size)
    return salts


def request_chain(token_ids: Sequence[int], block_size: int, *, adapter: str = "", cache_salt: str = "",
                  images: Sequence[tuple[str, int, int]] = ()) -> list[int]:
    """A request's chain: from its adapter's and cache salt's root (`chain_root`), each block
    salted by the images in it (`images`: `(identifier, start, length)` of each image's
    placeholder tokens)."""
    root = chain_root(adapter, cache_salt)
    if not images:
        return block_hash_chain(token_ids, block_size, parent_hash=root)
    salts = image_block_salts(images, block_size, len(token_ids) // block_size)
    hashes: list[int] = []
    for block, salt in enumerate(salts):
        root = hash_block(root, token_ids[block * block_size:(block + 1) * block_size], salt)
        hashes.append(root)
    return hashes
