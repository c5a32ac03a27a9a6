"""Schema round-trips and the subject catalog, on plain data."""

from __future__ import annotations

import msgspec
import pytest

from shared.block_hash import block_hash_chain, hash_block
from shared.codec import Codec, MalformedCounter, encode
from shared.compat import KvLayout
from shared.schemas import (
    Accepted,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cancel,
    ControlMessage,
    Drain,
    Failed,
    Finished,
    GenerateRequest,
    KvEventBatch,
    KvHandle,
    KvSnapshotRequest,
    KvTarget,
    KvTransferParams,
    LoadSnapshot,
    MembershipChange,
    PushDone,
    PushTarget,
    RequestRecord,
    ResponseFrame,
    SamplingParams,
    Tokens,
    TransferRecord,
    WorkerCapacity,
    WorkerRegistration,
    WorkerRole,
)
from shared.schemas import transfer as wire
from shared.subjects import Subjects

HANDLE = KvHandle(holder_worker_id="w1", agent_name="a", lease_id="l1", compat_hash="c", block_size=16,
                  block_ids=[3, 4], block_hashes=[11, 12], checksums=[5, 6], ttl_s=5.0)

REGISTRATION = WorkerRegistration(
    worker_id="w1", role=WorkerRole.DECODE, model="tiny", engine="sim", block_size=16, compat_hash="abc",
    capacity=WorkerCapacity(kv_blocks=64, max_num_seqs=8, max_model_len=2048), started_at=1.0, heartbeat_at=2.0,
)

MESSAGES = [
    (GenerateRequest, GenerateRequest(request_id="r1", model="tiny", token_ids=[1, 2, 3],
                                      sampling=SamplingParams(max_tokens=4, temperature=0.5, seed=7))),
    (ResponseFrame, Accepted(seq=0, worker_id="w1")),
    (ResponseFrame, Tokens(seq=1, token_ids=[5, 6])),
    (ResponseFrame, Finished(seq=2, finish_reason="length", prompt_tokens=3, cached_tokens=0, completion_tokens=2)),
    (ResponseFrame, Failed(seq=3, code="internal", message="boom")),
    (ControlMessage, Cancel(request_id="r1")),
    (ControlMessage, Drain(deadline_s=3.0)),
    (ControlMessage, KvSnapshotRequest()),
    (KvEventBatch, KvEventBatch(worker_id="w1", seq=1, ts=1.5, events=[
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(32)), block_size=16),
        BlockRemoved(block_hashes=[1]), AllBlocksCleared()])),
    (LoadSnapshot, LoadSnapshot(worker_id="w1", seq=4, ts=1.0, running=1, waiting=2, kv_total_blocks=64,
                                kv_used_blocks=3, kv_cached_blocks=9, prompt_tokens_total=100,
                                cached_tokens_total=40, generated_tokens_total=7, pending_prefill_tokens=12)),
    (WorkerRegistration, REGISTRATION),
    (MembershipChange, MembershipChange(kind="joined", worker_id="w1", reason="registered", registration=REGISTRATION)),
    (wire.LeaseMessage, wire.LeaseRequest(requester_worker_id="w2", compat_hash="c", block_hashes=[1, 2], ttl_s=5.0)),
    (wire.LeaseMessage, wire.LeaseRelease(lease_id="l1", outcome="failed", failed_blocks=[1])),
    (wire.LeaseMessage, wire.LeaseExtend(lease_id="l1", ttl_s=2.0)),
    (wire.LeaseMessage, wire.AgentInfoRequest(requester_worker_id="w2", compat_hash="c")),
    (wire.LeaseReply, wire.LeaseGrant(handle=HANDLE)),
    (wire.LeaseReply, wire.LeaseRefused(reason="no such blocks", code="not_found")),
    (wire.LeaseReply, wire.LeaseAck(lease_id="l1", ok=True)),
    (wire.LeaseReply, wire.AgentInfo(worker_id="w1", agent_name="a", compat_hash="c", metadata=b"\x00\x01")),
    (ControlMessage, PushDone(transfer_id="t", outcome="done", checksums=[3], first_token=9)),
    (ResponseFrame, KvTarget(seq=1, target=PushTarget(reader_worker_id="w2", agent_name="a", transfer_id="t",
                                                      compat_hash="c", block_ids=[4, 5]))),
    (ResponseFrame, Finished(seq=2, finish_reason="length", prompt_tokens=3, cached_tokens=0, completion_tokens=1,
                             kv_handle=HANDLE, pulled_tokens=16, recomputed_tokens=16)),
    (GenerateRequest, GenerateRequest(request_id="r2", model="tiny", token_ids=[1],
                                      kv_transfer=KvTransferParams(source=HANDLE))),
    (TransferRecord, TransferRecord(worker_id="w2", request_id="r", kind="pull", peer_worker_id="w1", outcome="done",
                                    blocks=2, blocks_ok=2, bytes=4096, duration_s=0.001, pulled_tokens=32,
                                    recomputed_tokens=0)),
    (RequestRecord, RequestRecord(request_id="r1", model="tiny", worker_id="w1", outcome="ok", finish_reason="stop",
                                  prompt_tokens=3, cached_tokens=0, completion_tokens=2, ttft_s=0.01, duration_s=0.1)),
]


@pytest.mark.parametrize("message_type,message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message_type, message) -> None:
    assert Codec(message_type).decode(encode(message)) == message


def test_union_dispatches_on_tag() -> None:
    frame = Codec(ResponseFrame).decode(encode(Tokens(seq=3, token_ids=[9])))
    assert isinstance(frame, Tokens) and frame.token_ids == [9]


def test_malformed_message_is_counted_not_raised() -> None:
    counter = MalformedCounter()
    codec: Codec[GenerateRequest] = Codec(GenerateRequest, counter)
    assert codec.decode_or_none(b"\xc1 not msgpack", "s1") is None
    assert codec.decode_or_none(encode(Cancel(request_id="x")), "s1") is None  # wrong type
    assert codec.decode_or_none(msgspec.msgpack.encode({"type": "generate", "request_id": 5}), "s2") is None
    assert counter.by_subject == {"s1": 2, "s2": 1}


def test_newer_schema_version_is_refused() -> None:
    newer = msgspec.structs.replace(Cancel(request_id="x"), v=99)
    assert Codec(ControlMessage).decode_or_none(encode(newer), "s") is None


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    raw = msgspec.msgpack.encode({"type": "cancel", "request_id": "x", "new_field": 1})
    assert Codec(ControlMessage).decode(raw) == Cancel(request_id="x")


def test_subject_catalog() -> None:
    subjects = Subjects("prod")
    assert subjects.generate("w-1") == "prod.v1.worker.w-1.generate"
    assert subjects.control("w-1", "drain") == "prod.v1.ctl.w-1.drain"
    assert subjects.control_all("w-1") == "prod.v1.ctl.w-1.*"
    assert subjects.kv_release("w-1") == "prod.v1.kv.release.w-1"
    assert subjects.kv_events("w-1") == "prod.v1.kv.events.w-1"
    assert subjects.kv_events_all == "prod.v1.kv.events.*"
    assert subjects.load("w-1") == "prod.v1.load.w-1"
    assert subjects.load_all == "prod.v1.load.*"
    assert subjects.membership_changes == "prod.v1.membership.changes"
    assert subjects.members_bucket == "prod_v1_members"
    assert subjects.kv_lease("w-1") == "prod.v1.kv.lease.w-1"
    assert subjects.kv_transfers_all == "prod.v1.kv.transfers.*"
    assert Subjects().generate("a") == "tandem.v1.worker.a.generate"


@pytest.mark.parametrize("bad", ["a.b", "a*", ">", "", "a b"])
def test_subject_tokens_are_checked(bad: str) -> None:
    with pytest.raises(ValueError):
        Subjects().generate(bad)
    with pytest.raises(ValueError):
        Subjects(bad)


def test_block_hash_chain_is_prefix_stable() -> None:
    tokens = list(range(100))
    chain = block_hash_chain(tokens, 16)
    assert len(chain) == 6  # the partial tail block is not hashed
    assert block_hash_chain(tokens[:48], 16) == chain[:3]
    assert chain[1] == hash_block(chain[0], tokens[16:32])
    assert block_hash_chain(tokens, 16, salt=b"lora-1") != chain
    assert block_hash_chain([1] + tokens[1:], 16)[5] != chain[5]  # a change early changes every later hash


def test_compat_hash_covers_what_kv_means_not_its_shape() -> None:
    layout = KvLayout(model="tiny", dtype="float16", block_size=16, num_layers=4, num_kv_heads=4,
                      head_size=64, engine="sim")
    same = KvLayout(model="tiny", dtype="float16", block_size=16, num_layers=4, num_kv_heads=4,
                    head_size=64, engine="sim")
    assert layout.compat_hash() == same.compat_hash()
    # a mapping converts block sizes of one family, TP and PP degrees: same hash, nothing refused
    for shape in (dict(block_size=32), dict(block_size=4), dict(tensor_parallel=2), dict(pipeline_parallel=2)):
        mapped = msgspec.structs.replace(layout, **shape)
        assert layout.compat_hash() == mapped.compat_hash() and not layout.refusal(mapped)
        assert layout.shape_differs(mapped)
    other = msgspec.structs.replace(layout, block_size=48)
    assert layout.compat_hash() != other.compat_hash()
    assert layout.mismatch(other) == ["block_size: 16 and 48 do not divide one another"]
    other = msgspec.structs.replace(layout, head_size=32)
    assert layout.compat_hash() != other.compat_hash()
    assert layout.refusal(other) == "head_size: 64 != 32"
