"""What the sim's KV bytes are: a function of each token's prefix, so that any reader, of
any block size or rank layout, can tell the KV it received is the KV of its tokens (pure:
numpy only).

Real KV of a token depends on every token before it. The sim mirrors that with a prefix
hash per token: `P[t] = P[t-1] * B + tokens[t] + 1 (mod 2^64)`, from the request's root
(`shared.block_hash.adapter_root`: another adapter, other KV). A block's bytes therefore
depend on the prefix hash before its first token (its `seed`) and its tokens, never on the
block size: blocks of 16 and of 32 tokens hold the same bytes for the same tokens, in
other places. Layer `l`, KV head `h`, K (0) or V (1) of token `t` is a 16-byte pattern of
`(P[t], l, h, kv)`, repeated over the head's vector.

Callers: `kv_pool.KvPool` (writes and verifies blocks), the scheduler and the port (each
block's seed), `block_manager` (a cached block keeps its seed, so the host tier can write
it again).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64
_BASE_INVERSE = pow(_BASE, -1, 1 << 64)


def _mix(value: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps, as it should)."""
    value = value + np.uint64(0x9E3779B97F4A7C15)
    value = (value ^ (value >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return value ^ (value >> np.uint64(31))


def _powers(base: int, count: int) -> np.ndarray:
    """base^0 .. base^(count-1) mod 2^64."""
    powers = np.full(count, base, dtype=np.uint64)
    powers[0] = 1
    return np.cumprod(powers, dtype=np.uint64)


def prefix_hashes(seed: int, token_ids: Sequence[int]) -> np.ndarray:
    """`P[t]` for each token, after the prefix whose hash is `seed`."""
    count = len(token_ids)
    if not count:
        return np.zeros(0, dtype=np.uint64)
    terms = np.asarray(token_ids, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        inverse = _powers(_BASE_INVERSE, count)
        forward = _powers(_BASE, count + 1)
        # P[k] = seed * B^(k+1) + sum_{i<=k} terms[i] * B^(k-i) = seed * B^(k+1) + B^k * sum_{i<=k} terms[i] * B^-i
        return np.uint64(seed & _MASK) * forward[1:] + forward[:-1] * np.cumsum(terms * inverse, dtype=np.uint64)


def advance(seed: int, token_ids: Sequence[int]) -> int:
    """The prefix hash after `token_ids`: the seed of the block that follows them."""
    return int(prefix_hashes(seed, token_ids)[-1]) if len(token_ids) else seed


def block_seeds(seed: int, token_ids: Sequence[int], block_size: int, count: int) -> list[int]:
    """The seeds of `count` consecutive blocks whose tokens are `token_ids`, from `seed`."""
    hashes = prefix_hashes(seed, token_ids[: max(0, count - 1) * block_size])
    return [seed] + [int(hashes[(index + 1) * block_size - 1]) for index in range(count - 1)]


def token_vectors(prefixes: np.ndarray, layers: range, heads: range, token_nbytes: int) -> np.ndarray:
    """The bytes of these tokens' vectors: `(layers, heads, 2, tokens, token_nbytes)` uint8."""
    layer = np.arange(layers.start, layers.stop, dtype=np.uint64).reshape(-1, 1, 1, 1)
    head = np.arange(heads.start, heads.stop, dtype=np.uint64).reshape(1, -1, 1, 1)
    kv = np.arange(2, dtype=np.uint64).reshape(1, 1, -1, 1)
    with np.errstate(over="ignore"):
        salt = (layer << np.uint64(48)) ^ (head << np.uint64(32)) ^ (kv << np.uint64(31))
        first = _mix(prefixes.reshape(1, 1, 1, -1) ^ salt)
        second = _mix(first ^ np.uint64(0xD1B54A32D192ED03))
    pattern = np.stack([first, second], axis=-1).view(np.uint8)  # (..., tokens, 16)
    if token_nbytes == 16:
        return pattern
    repeats = -(-token_nbytes // 16)
    return np.tile(pattern, (1, 1, 1, 1, repeats))[..., :token_nbytes]


def next_prefix(prefix: int, token_id: int) -> int:
    """`P[t]` from `P[t-1]`: one generated token (Python ints, no array)."""
    return (prefix * _BASE + token_id + 1) & _MASK
