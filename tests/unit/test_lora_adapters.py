"""LoRA adapters of one base model: how a request names one (`"<model>:<adapter>"`), and
the KV identity it carries (`shared.block_hash.adapter_root`). A sim worker serving a prompt
with one adapter announces blocks that the router's index matches for that adapter only:
never for another adapter of the same model, nor for the base model; requests without an
adapter hash exactly as before."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from services.router.http.served_models import ServedModel, ServedModels, split_adapter
from services.router.kv.model_kv import ModelKv
from services.router.openai.errors import ModelNotFound
from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_content import block_seeds
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.kv_port import SimKvPort
from services.worker.sim.scheduler import Scheduler
from services.worker.sim.tokens import HISTORY_ROOT, history_root
from services.worker.vllm.kv_event_wire import WireDecoder
from services.worker.vllm.kv_mirror import KvBlockMirror
from shared.block_hash import ROOT_PARENT, adapter_root, block_hash_chain
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import BlockStored, KvEventBatch
from shared.tokenizer import Tokenizer
from tests.unit.test_router_served_models import RegisteredModels
from tests.unit.test_sim_scheduler import PROFILE, VOCAB, prompt, run_to_completion

BS = 4


def sim_scheduler() -> Scheduler:
    return Scheduler(blocks=BlockManager(64, BS), pool=KvPool(64, num_layers=2, block_size=BS, kv_dim=4),
                     profile=PROFILE, vocab_size=VOCAB, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256)


def served(scheduler: Scheduler, token_ids: list[int], adapter: str, request_id: str = "r") -> list[int]:
    """The tokens the sim answers `token_ids` with under `adapter` (greedy, 8 tokens)."""
    scheduler.add_request(request_id, token_ids, SamplingParams(max_tokens=8), adapter=adapter)
    tokens, _, _ = run_to_completion(scheduler)
    return tokens[request_id]


def index_of(worker_id: str, scheduler: Scheduler, *, verify_hashes: bool = False) -> ModelKv:
    """A model's KV namespace that has ingested every event `scheduler` produced so far."""
    kv = ModelKv(verify_hashes=verify_hashes)
    kv.worker_joined(worker_id, BS)
    kv.index.ingest(KvEventBatch(worker_id=worker_id, seq=1, ts=0.0, events=scheduler.blocks.take_events()))
    return kv


def test_a_request_without_adapter_hashes_as_before() -> None:
    token_ids = prompt(3 * BS)
    assert adapter_root("") == ROOT_PARENT
    assert block_hash_chain(token_ids, BS, parent_hash=adapter_root("")) == block_hash_chain(token_ids, BS)
    assert history_root("") == HISTORY_ROOT


def test_each_adapter_has_its_own_root() -> None:
    roots = {adapter_root(name) for name in ("", "alpha", "beta", "alpha2", "a:b")}
    assert len(roots) == 5
    assert adapter_root("alpha") == adapter_root("alpha")  # a name's root is stable across processes
    assert len({history_root(name) for name in ("", "alpha", "beta")}) == 3


def test_model_names_split_into_base_and_adapter() -> None:
    assert split_adapter("tiny:alpha") == ("tiny", "alpha")
    assert split_adapter("org/model:v2:alpha") == ("org/model:v2", "alpha")
    assert split_adapter("tiny") == ("tiny", "")
    assert split_adapter("tiny:") == ("tiny:", "") and split_adapter(":alpha") == (":alpha", "")


def test_a_request_names_an_adapter_of_a_served_model(tiny_model_dir: str) -> None:
    own = ServedModel("tiny", Tokenizer.from_model_dir(tiny_model_dir))
    models = ServedModels(own, RegisteredModels({"tiny": [tiny_model_dir], "m:v2": [tiny_model_dir]}))  # type: ignore[arg-type]
    alpha = asyncio.run(models.resolve("tiny:alpha"))
    assert (alpha.name, alpha.adapter, alpha.tokenizer) == ("tiny", "alpha", own.tokenizer)
    assert asyncio.run(models.resolve("tiny")).adapter == ""
    versioned = asyncio.run(models.resolve("m:v2"))  # a served name with a colon is that model
    assert (versioned.name, versioned.adapter) == ("m:v2", "")
    with pytest.raises(ModelNotFound):
        asyncio.run(models.resolve("other:alpha"))


def test_an_adapter_is_asked_for_by_its_own_name_when_one_model_holds_it(tiny_model_dir: str) -> None:
    own = ServedModel("tiny", Tokenizer.from_model_dir(tiny_model_dir))
    pool = RegisteredModels({"tiny": [tiny_model_dir], "other": [tiny_model_dir]},
                            adapters={"tiny": ["alpha", "shared"], "other": ["shared"]})
    models = ServedModels(own, pool)  # type: ignore[arg-type]
    alpha = asyncio.run(models.resolve("alpha"))
    assert (alpha.name, alpha.adapter) == ("tiny", "alpha")
    with pytest.raises(ModelNotFound):  # held by two models' workers: which one is not said
        asyncio.run(models.resolve("shared"))
    with pytest.raises(ModelNotFound):
        asyncio.run(models.resolve("gamma"))


def test_the_sim_answers_each_adapter_with_its_own_tokens() -> None:
    token_ids = prompt(2 * BS + 1)
    answers = {adapter: served(sim_scheduler(), token_ids, adapter) for adapter in ("", "alpha", "beta")}
    assert len({tuple(answer) for answer in answers.values()}) == 3
    assert served(sim_scheduler(), token_ids, "alpha") == answers["alpha"]  # deterministic


def test_the_index_never_matches_a_prefix_across_adapters_of_one_model() -> None:
    token_ids = prompt(4 * BS)
    scheduler = sim_scheduler()
    served(scheduler, token_ids, "alpha")
    kv = index_of("w1", scheduler)
    assert kv.prompt_cache(token_ids, 0.0, adapter="alpha").cached_tokens == {"w1": 4 * BS}
    assert kv.prompt_cache(token_ids, 0.0, adapter="beta").cached_tokens == {}
    assert kv.prompt_cache(token_ids, 0.0).cached_tokens == {}  # nor the base model's
    alpha, beta = (kv.prompt_cache(token_ids, 0.0, adapter=name) for name in ("alpha", "beta"))
    assert alpha.prefix_key != beta.prefix_key  # nor do their prefix homes meet


def test_a_routers_own_hashing_of_the_sims_events_agrees_with_the_worker() -> None:
    """With --verify-kv-hashes the router hashes the events' tokens from the adapter they name:
    the sim's chains verify, and still match only their adapter."""
    token_ids = prompt(4 * BS)
    scheduler = sim_scheduler()
    served(scheduler, token_ids, "alpha")
    kv = index_of("w1", scheduler, verify_hashes=True)
    assert kv.index.stats().mismatched_blocks == 0
    assert kv.prompt_cache(token_ids, 0.0, adapter="alpha").cached_tokens == {"w1": 4 * BS}
    assert kv.prompt_cache(token_ids, 0.0, adapter="beta").cached_tokens == {}
    snapshot = scheduler.blocks.snapshot()
    assert snapshot and all(event.adapter == "alpha" for event in snapshot)


def test_the_sim_reuses_kv_only_within_an_adapter() -> None:
    token_ids = prompt(4 * BS)
    scheduler = sim_scheduler()
    served(scheduler, token_ids, "alpha", "first")
    scheduler.add_request("other", token_ids, SamplingParams(max_tokens=2), adapter="beta")
    scheduler.add_request("same", token_ids, SamplingParams(max_tokens=2), adapter="alpha")
    _, finals, _ = run_to_completion(scheduler)
    assert finals["other"].cached_tokens == 0
    assert finals["same"].cached_tokens == 3 * BS  # the last prompt token is always computed


def test_received_blocks_verify_against_the_adapters_chain() -> None:
    token_ids = prompt(2 * BS)
    port = SimKvPort(BlockManager(8, BS), KvPool(8, num_layers=2, block_size=BS, kv_dim=4))
    seeds = block_seeds(adapter_root("alpha"), token_ids, BS, 2)  # the KV of alpha's blocks
    for verified_adapter, expected in (("", [False, False]), ("beta", [False, False]), ("alpha", [True, True])):
        block_ids = port.allocate_for_transfer(2)
        assert block_ids is not None
        for index, (block_id, seed) in enumerate(zip(block_ids, seeds)):
            port.pool.write_block(block_id, seed, token_ids[index * BS:(index + 1) * BS])
        assert port.commit_transferred(block_ids, 0, token_ids, [True, True], adapter=verified_adapter) == expected
        port.unpin(block_ids)


def test_a_vllm_workers_events_chain_from_the_adapter_it_names() -> None:
    """vLLM names the adapter of stored blocks (`lora_name`); the worker's mirror chains them
    from that adapter's root, as the router hashes the adapter's requests."""
    token_ids = prompt(2 * BS)
    payload = msgspec.msgpack.encode([0.0, [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": token_ids,
         "block_size": BS, "lora_id": 1, "medium": "GPU", "lora_name": "alpha"},
        {"type": "BlockStored", "block_hashes": [21, 22], "parent_block_hash": None, "token_ids": token_ids,
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}], 0])
    alpha, base = WireDecoder().decode(payload).events
    assert isinstance(alpha, BlockStored) and isinstance(base, BlockStored)
    assert (alpha.adapter, base.adapter) == ("alpha", "")
    mirror = KvBlockMirror(BS)
    [passed_alpha], [passed_base] = mirror.apply(alpha), mirror.apply(base)
    assert passed_alpha.chain_hashes == block_hash_chain(token_ids, BS, parent_hash=adapter_root("alpha"))
    assert passed_base.chain_hashes == block_hash_chain(token_ids, BS)
    assert passed_alpha.adapter == "alpha"
    assert sorted(event.adapter for event in mirror.snapshot()) == ["", "alpha"]  # a resync names them too


def test_an_index_that_hashes_events_itself_starts_from_their_adapter() -> None:
    """With --verify-kv-hashes the router hashes each event's tokens: from the root of the
    adapter the event names, so an adapter's blocks verify and match only its requests."""
    token_ids = prompt(2 * BS)
    chain = block_hash_chain(token_ids, BS, parent_hash=adapter_root("alpha"))
    kv = ModelKv(verify_hashes=True)
    kv.worker_joined("w1", BS)
    kv.index.ingest(KvEventBatch(worker_id="w1", seq=1, ts=0.0, events=[BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=token_ids, block_size=BS, chain_hashes=chain,
        adapter="alpha")]))
    assert kv.index.stats().mismatched_blocks == 0
    assert kv.prompt_cache(token_ids, 0.0, adapter="alpha").cached_tokens == {"w1": 2 * BS}
    assert kv.prompt_cache(token_ids, 0.0).cached_tokens == {}


def test_a_generated_adapter_has_peft_layout_for_its_base_model(tiny_model_dir: str, tmp_path) -> None:
    from safetensors.numpy import load_file

    from shared.lora_adapter import generate_lora_adapter

    generate_lora_adapter(str(tmp_path / "alpha"), tiny_model_dir, rank=8, seed=1)
    generate_lora_adapter(str(tmp_path / "beta"), tiny_model_dir, rank=8, seed=2)
    config = json.loads((tmp_path / "alpha" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == ("LORA", 8, ["q_proj", "v_proj"])
    alpha, beta = (load_file(str(tmp_path / name / "adapter_model.safetensors")) for name in ("alpha", "beta"))
    base = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    layer = "base_model.model.model.layers.0.self_attn"
    heads, kv_heads, head_dim = base["num_attention_heads"], base["num_key_value_heads"], base["head_dim"]
    assert alpha[f"{layer}.q_proj.lora_A.weight"].shape == (8, base["hidden_size"])
    assert alpha[f"{layer}.q_proj.lora_B.weight"].shape == (heads * head_dim, 8)
    assert alpha[f"{layer}.v_proj.lora_B.weight"].shape == (kv_heads * head_dim, 8)
    assert len(alpha) == base["num_hidden_layers"] * 2 * 2
    assert not (alpha[f"{layer}.v_proj.lora_B.weight"] == beta[f"{layer}.v_proj.lora_B.weight"]).all()
