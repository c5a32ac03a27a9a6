"""Which workers may exchange KV blocks: the compatibility hash and the mapping rule.

A `KvLayout` splits in two. What must be equal for KV to mean the same thing (the model
and its version, dtype, head size, the number of layers and KV heads in total, the
attention kind, the engine's KV format and the connector protocol's version) goes into the
compatibility hash, with the block size's family (its odd part: two sizes of one family
divide one another). What a mapping converts does not: the block size itself, the tensor-
parallel degree (which KV heads each rank holds) and the pipeline-parallel degree (which
layers). Workers with equal hashes can always exchange blocks (`connector.range_plan` maps
them); `refusal` names the field that stops two others.
"""

from __future__ import annotations

import hashlib

import msgspec

# 2: a block's checksums are per KV head (`connector.kv_checksums`), so readers of another
# shape can verify what they read.
CONNECTOR_PROTOCOL_VERSION = 2

MEANING = ("model", "model_version", "dtype", "num_layers", "num_kv_heads", "head_size", "attention", "engine",
           "connector_version")


class KvLayout(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    model_version: str = ""
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    engine: str
    connector_version: int = CONNECTOR_PROTOCOL_VERSION
    attention: str = "full"  # the attention kind whose KV this is (full, sliding window, MLA...)
    tensor_parallel: int = 1  # ranks that split the KV heads (a mapping converts)
    pipeline_parallel: int = 1  # stages that split the layers (a mapping converts)

    @property
    def block_family(self) -> int:
        """The block size's odd part: sizes of one family divide one another."""
        size = self.block_size
        while size and size % 2 == 0:
            size //= 2
        return size

    def compat_hash(self) -> str:
        meaning = {name: getattr(self, name) for name in MEANING}
        return hashlib.sha256(msgspec.json.encode([meaning, self.block_family])).hexdigest()[:16]

    def mismatch(self, other: KvLayout) -> list[str]:
        """What stops the two from exchanging blocks, for an error message a person can act
        on: the fields of meaning that differ, and block sizes neither of which divides the
        other. Empty: a mapping exists (the shape may still differ)."""
        differ = [f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
                  for name in MEANING if getattr(self, name) != getattr(other, name)]
        if self.block_family != other.block_family:
            differ.append(f"block_size: {self.block_size} and {other.block_size} do not divide one another")
        return differ

    def shape_differs(self, other: KvLayout) -> list[str]:
        """The fields a mapping converts between the two (informational)."""
        return [f"{name}: {getattr(self, name)!r} -> {getattr(other, name)!r}"
                for name in ("block_size", "tensor_parallel", "pipeline_parallel")
                if getattr(self, name) != getattr(other, name)]

    def refusal(self, other: KvLayout) -> str:
        """Why KV cannot move between the two ("" when it can)."""
        differ = self.mismatch(other)
        return "; ".join(differ)
