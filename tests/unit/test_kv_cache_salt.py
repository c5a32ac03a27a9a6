"""vLLM's `cache_salt` in Tandem's chains: the root it starts (`shared.block_hash.chain_root`),
and vLLM's store events of a salted request (the salt a bare string among the first block's
extra keys, after a LoRA's name) through the worker's mirror to a router that hashes or
verifies chains itself: the chain is the salted one the request path computes."""

from __future__ import annotations

import msgspec

from services.router.kv.index import KvIndex
from services.worker.vllm.kv_mirror import KvBlockMirror
from shared.block_hash import ROOT_PARENT, adapter_root, chain_root, request_chain
from shared.schemas.kv_events import BlockStored, KvEventBatch, for_wire
from tests.unit.test_kv_image_hash_verification import through_mirror
from tests.unit.test_kv_index import tokens

BS = 4
PROMPT = tokens(11, 3 * BS)


def test_a_salt_gives_its_own_root_and_none_leaves_the_adapters() -> None:
    assert chain_root() == ROOT_PARENT and chain_root("lora-1") == adapter_root("lora-1")
    roots = {chain_root(adapter, salt) for adapter in ("", "lora-1") for salt in ("", "a", "b")}
    assert len(roots) == 6 and ROOT_PARENT in roots
    plain, salted = request_chain(PROMPT, BS), request_chain(PROMPT, BS, cache_salt="a")
    assert not set(plain) & set(salted)  # no block of a salted prompt matches an unsalted one
    assert salted == request_chain(PROMPT, BS, cache_salt="a") != request_chain(PROMPT, BS, cache_salt="b")


def stored_through_mirror(first_keys: list | None, lora: str | None = None) -> tuple[KvBlockMirror, BlockStored]:
    """The prompt's 3 blocks; the first's extra keys `first_keys`, the others' the adapter's name."""
    later = [lora] if lora else None
    return through_mirror([41, 42, 43], PROMPT, [first_keys, later, later], block_size=BS, lora_name=lora)


def test_the_mirror_chains_a_salted_prompt_from_its_salts_root() -> None:
    _, passed = stored_through_mirror(["tenant-a"])
    assert passed.cache_salt == "tenant-a"
    assert passed.chain_hashes == request_chain(PROMPT, BS, cache_salt="tenant-a")
    _, with_lora = stored_through_mirror(["lora-1", "tenant-a"], lora="lora-1")
    assert with_lora.cache_salt == "tenant-a"
    assert with_lora.chain_hashes == request_chain(PROMPT, BS, adapter="lora-1", cache_salt="tenant-a")
    _, lora_only = stored_through_mirror(["lora-1"], lora="lora-1")
    assert lora_only.cache_salt == "" and lora_only.chain_hashes == request_chain(PROMPT, BS, adapter="lora-1")


def test_a_snapshot_announces_the_root_with_its_salt() -> None:
    mirror, passed = stored_through_mirror(["tenant-a"])
    [again] = mirror.snapshot()
    assert (again.cache_salt, again.chain_hashes) == ("tenant-a", passed.chain_hashes)


def test_a_verifying_router_indexes_the_salted_chain_and_only_that_salt_matches() -> None:
    _, passed = stored_through_mirror(["tenant-a"])
    passed.chain_hashes = None  # the router hashes the tokens itself, from the salt's root
    index = KvIndex(verify_hashes=True)
    index.add_worker("w", BS)
    batch = KvEventBatch(worker_id="w", seq=1, ts=0.0, events=for_wire([passed]))
    result = index.ingest(msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KvEventBatch))
    assert (result.stored_blocks, result.mismatched_blocks) == (3, 0)
    assert index.match(request_chain(PROMPT, BS, cache_salt="tenant-a")) == {"w": 3}
    assert index.match(request_chain(PROMPT, BS, cache_salt="tenant-b")) == {}
    assert index.match(request_chain(PROMPT, BS)) == {}
