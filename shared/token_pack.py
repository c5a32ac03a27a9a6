"""Token ids packed as bytes: 4 bytes each, unsigned, little-endian. Pure.

What KV events carry on the wire (`shared.schemas.kv_events.BlockStored.packed_token_ids`)
and what Tandem's block hash reads (`shared.block_hash`): one msgpack `bin` that a consumer
not reading the token ids steps over at once, where a msgpack array of ints costs it a step
per token (16 per block, where the hashes are 2). A token id is a vocabulary index: it fits
in 32 bits; one that does not (or is negative) is refused when packing.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_TYPECODE = "I" if array("I").itemsize == 4 else "L"  # a 4-byte unsigned int on every platform
assert array(_TYPECODE).itemsize == 4, "no 4-byte unsigned array type"
_SWAP = sys.byteorder != "little"
TOKEN_BYTES = 4


def pack_token_ids(token_ids: Iterable[int]) -> bytes:
    """`token_ids` as 4-byte little-endian unsigned ints; OverflowError for one outside [0, 2^32)."""
    packed = array(_TYPECODE, token_ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes | bytearray | memoryview) -> list[int]:
    """The token ids `pack_token_ids` packed; ValueError for a length that is not a multiple of 4."""
    return token_array(data).tolist()


def token_array(data: bytes | bytearray | memoryview) -> array:
    """As `unpack_token_ids`, as a 4-byte array (native byte order)."""
    if len(data) % TOKEN_BYTES:
        raise ValueError(f"packed token ids of {len(data)} bytes: not a multiple of {TOKEN_BYTES}")
    tokens = array(_TYPECODE)
    tokens.frombytes(data)
    if _SWAP:
        tokens.byteswap()
    return tokens
