"""Scheduler: chunked prefill under a token budget, prefix reuse, preemption, no leaks."""

from __future__ import annotations

import random

import pytest

from services.worker.sim.block_manager import BlockManager
from services.worker.sim.kv_content import advance, block_seeds
from services.worker.sim.kv_pool import KvPool
from services.worker.sim.profile import TimingProfile
from services.worker.sim.scheduler import Scheduler, StepResult
from services.worker.sim.tokens import generate_tokens
from shared.block_hash import ROOT_PARENT, block_hash_chain
from shared.errors import InvalidArgument
from shared.schemas.generate import SamplingParams
from shared.schemas.kv_events import BlockRemoved, BlockStored

BS = 4
VOCAB = 500
PROFILE = TimingProfile(prefill_ms_per_token=0.05, step_overhead_ms=1.0, decode_base_ms=8.0, decode_ms_per_seq=0.1)


def make_scheduler(*, num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, max_model_len: int = 256,
                   with_pool: bool = True) -> Scheduler:
    pool = KvPool(num_blocks, num_layers=2, block_size=BS, kv_dim=4) if with_pool else None
    return Scheduler(blocks=BlockManager(num_blocks, BS), pool=pool, profile=PROFILE, vocab_size=VOCAB,
                     max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)


def prompt(length: int, start: int = 3) -> list[int]:
    return [start + i % (VOCAB - start) for i in range(length)]


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> tuple[dict[str, list[int]], dict, list[StepResult]]:
    """Step until idle; returns tokens and final outputs per request, and every step."""
    tokens: dict[str, list[int]] = {}
    finals = {}
    steps: list[StepResult] = []
    for step in range(max_steps):
        if not scheduler.has_work:
            return tokens, finals, steps
        result = scheduler.step(now=float(step))
        steps.append(result)
        check_invariants(scheduler, result)
        for request_id, output in result.outputs.items():
            tokens.setdefault(request_id, []).extend(output.token_ids)
            if output.finished:
                finals[request_id] = output
    raise AssertionError("requests did not finish")


def check_invariants(scheduler: Scheduler, result: StepResult) -> None:
    blocks = scheduler.blocks
    assert result.prefill_tokens + result.decode_seqs <= scheduler.max_num_batched_tokens
    assert blocks.used_blocks + blocks.free_blocks == blocks.num_blocks
    assert scheduler.load().running <= scheduler.max_num_seqs


def test_chunked_prefill_respects_the_budget() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add_request("r", prompt(40), SamplingParams(max_tokens=3))
    tokens, finals, steps = run_to_completion(scheduler)
    assert [step.prefill_tokens for step in steps] == [16, 16, 8, 0, 0]
    assert [step.decode_seqs for step in steps] == [0, 0, 0, 1, 1]
    assert [bool(step.outputs) for step in steps] == [False, False, True, True, True]
    assert tokens["r"] == generate_tokens(prompt(40), SamplingParams(max_tokens=3), VOCAB)[0]
    assert finals["r"].finish_reason == "length" and finals["r"].completion_tokens == 3
    assert steps[0].duration_s == pytest.approx((1.0 + 16 * 0.05) / 1000)
    assert steps[3].duration_s == pytest.approx((1.0 + 8.0 + 0.1) / 1000)
    assert scheduler.blocks.used_blocks == 0


def test_decodes_get_a_token_while_a_long_prompt_prefills() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add_request("short", prompt(4), SamplingParams(max_tokens=10))
    scheduler.step(0.0)  # "short" is decoding from now on
    scheduler.add_request("long", prompt(64, start=100), SamplingParams(max_tokens=2))
    result = scheduler.step(1.0)
    assert (result.decode_seqs, result.prefill_tokens) == (1, 15)
    assert len(result.outputs["short"].token_ids) == 1
    assert scheduler.load().pending_prefill_tokens == 64 - 15


def test_repeated_prompt_hits_the_prefix_cache_without_spending_budget() -> None:
    scheduler = make_scheduler(budget=16)
    text = prompt(32)
    sampling = SamplingParams(max_tokens=4)
    scheduler.add_request("first", text, sampling)
    first_tokens, first_finals, _ = run_to_completion(scheduler)
    assert first_finals["first"].cached_tokens == 0

    scheduler.add_request("again", text, sampling)
    result = scheduler.step(100.0)
    # 7 of 8 blocks are reused; the last block is recomputed so the last token has logits.
    assert result.prefill_tokens == 4 and "again" in result.outputs
    tokens, finals, _ = run_to_completion(scheduler)
    assert result.outputs["again"].token_ids + tokens["again"] == first_tokens["first"]
    assert finals["again"].cached_tokens == 28 and finals["again"].prompt_tokens == 32
    load = scheduler.load()
    assert (load.prompt_tokens_total, load.cached_tokens_total, load.generated_tokens_total) == (64, 28, 8)
    assert load.kv_used_blocks == 0


def test_events_carry_the_tandem_hash_chain_and_kv_bytes_match() -> None:
    scheduler = make_scheduler(budget=8)
    text = prompt(18)
    scheduler.add_request("r", text, SamplingParams(max_tokens=7))
    tokens, _, _ = run_to_completion(scheduler)
    stored = [event for event in scheduler.blocks.take_events() if isinstance(event, BlockStored)]
    history = text + tokens["r"]
    # KV exists for every token but the last generated one: 24 tokens, 6 full blocks.
    expected = block_hash_chain(history[:-1], BS)
    assert [h for event in stored for h in event.block_hashes] == expected
    assert [t for event in stored for t in event.token_ids] == history[:len(expected) * BS]
    assert stored[0].parent_block_hash is None
    for previous, event in zip(stored, stored[1:]):
        assert event.parent_block_hash == previous.block_hashes[-1]
    assert [len(event.block_hashes) for event in stored[:2]] == [2, 2]  # one event per request per step
    for block_id in scheduler.blocks.match_prefix(expected):
        assert scheduler.pool.verify_block(block_id, *scheduler.blocks.content(block_id))


def test_partial_block_kv_is_derived_from_its_tokens() -> None:
    scheduler = make_scheduler()
    text = prompt(6)
    scheduler.add_request("r", text, SamplingParams(max_tokens=5))
    scheduler.step(0.0)
    request_blocks = scheduler.block_ids("r")
    assert scheduler.pool.verify_block(request_blocks[0], ROOT_PARENT, text[:4])
    assert scheduler.pool.verify_block(request_blocks[1], advance(ROOT_PARENT, text[:4]), text[4:6])
    assert not scheduler.pool.verify_block(request_blocks[1], advance(ROOT_PARENT, text[:4]), text[4:6] + [0])
    scheduler.abort("r")


def test_preemption_recomputes_and_still_finishes_every_request() -> None:
    # 8 blocks of 4 tokens; each request grows to 4 + 19 = 23 tokens (6 blocks): they cannot all fit.
    scheduler = make_scheduler(num_blocks=8, budget=16, max_seqs=4)
    sampling = SamplingParams(max_tokens=20)
    prompts = {f"r{i}": prompt(4, start=10 + 7 * i) for i in range(3)}
    for request_id, text in prompts.items():
        scheduler.add_request(request_id, text, sampling)
    tokens, finals, steps = run_to_completion(scheduler)
    preempted = [request_id for step in steps for request_id in step.preempted]
    assert preempted and scheduler.preemptions_total == len(preempted)
    assert "r0" not in preempted  # the oldest request always makes progress
    for request_id, text in prompts.items():
        assert tokens[request_id] == generate_tokens(text, sampling, VOCAB)[0]
        assert finals[request_id].completion_tokens == 20
    assert scheduler.blocks.used_blocks == 0 and scheduler.load().running == 0


def test_abort_frees_blocks_at_once() -> None:
    scheduler = make_scheduler(budget=8)
    scheduler.add_request("r", prompt(30), SamplingParams(max_tokens=5))
    scheduler.step(0.0)
    assert scheduler.blocks.used_blocks == 2
    final = scheduler.abort("r")
    assert final is not None and final.finish_reason == "abort" and final.prompt_tokens == 30
    assert scheduler.blocks.used_blocks == 0 and not scheduler.has_work
    assert scheduler.abort("r") is None
    scheduler.add_request("waiting", prompt(5), SamplingParams())
    assert scheduler.abort("waiting") is not None and not scheduler.has_work


def test_admission_limits() -> None:
    scheduler = make_scheduler(budget=64, max_seqs=2)
    for index in range(3):
        scheduler.add_request(f"r{index}", prompt(5, start=20 * index + 3), SamplingParams(max_tokens=2))
    result = scheduler.step(0.0)
    assert set(result.outputs) == {"r0", "r1"}
    load = scheduler.load()
    assert (load.running, load.waiting, load.pending_prefill_tokens) == (2, 1, 5)


@pytest.mark.parametrize(("tokens", "max_tokens", "message"), [
    (300, 1, "more than the maximum context length of 256"),
    (250, 10, "exceeds the maximum context length"),
    (0, 1, "empty"),
    (10, 0, "max_tokens must be at least 1"),
])
def test_invalid_requests(tokens: int, max_tokens: int, message: str) -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidArgument, match=message):
        scheduler.add_request("r", prompt(tokens), SamplingParams(max_tokens=max_tokens))
    assert not scheduler.has_work


def test_request_larger_than_the_pool_and_bad_ids_are_refused() -> None:
    scheduler = make_scheduler(num_blocks=4)
    with pytest.raises(InvalidArgument, match="needs 5 KV blocks, the whole pool has 4"):
        scheduler.add_request("r", prompt(17), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidArgument, match="token ids"):
        scheduler.add_request("r", [3, VOCAB], SamplingParams())
    scheduler.add_request("r", prompt(3), SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgument, match="duplicate"):
        scheduler.add_request("r", prompt(3), SamplingParams(max_tokens=2))


def test_random_workload_finishes_without_leaks() -> None:
    rng = random.Random(1234)
    scheduler = make_scheduler(num_blocks=40, budget=24, max_seqs=5, with_pool=False)
    shared_prefixes = [prompt(rng.randint(4, 24), start=rng.randint(3, 400)) for _ in range(4)]
    expected = {}
    for index in range(30):
        text = rng.choice(shared_prefixes) + prompt(rng.randint(1, 20), start=rng.randint(3, 400))
        sampling = SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.7]), seed=index,
                                  stop_token_ids=[rng.randint(3, VOCAB - 1)])
        scheduler.add_request(f"r{index}", text, sampling)
        expected[f"r{index}"] = generate_tokens(text, sampling, VOCAB)
    tokens, finals, steps = run_to_completion(scheduler)
    assert set(finals) == set(expected)
    for request_id, (output, reason) in expected.items():
        assert tokens[request_id] == output and finals[request_id].finish_reason == reason
    assert sum(final.cached_tokens for final in finals.values()) > 0
    assert scheduler.blocks.used_blocks == 0
    # The events replayed into an index agree with what the pool has cached.
    index: set[int] = set()
    for event in scheduler.blocks.take_events():
        if isinstance(event, BlockStored):
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.difference_update(event.block_hashes)
    assert index == {h for event in scheduler.blocks.snapshot() for h in event.block_hashes}
    assert len(index) == scheduler.blocks.cached_blocks


# ---- holes in the cached prefix, KV integrity ------------------------------------------------

class RecordingPool(KvPool):
    """A pool that remembers which blocks were written (to show reused blocks are not)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.written: list[int] = []

    def write_block(self, block_id: int, seed: int, token_ids: list[int], layer: int | None = None) -> None:
        self.written.append(block_id)
        super().write_block(block_id, seed, token_ids, layer)


def make_recording_scheduler(*, num_blocks: int = 64, budget: int = 64) -> Scheduler:
    pool = RecordingPool(num_blocks, num_layers=2, block_size=BS, kv_dim=4)
    return Scheduler(blocks=BlockManager(num_blocks, BS), pool=pool, profile=PROFILE, vocab_size=VOCAB,
                     max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256)


def seed_cache(scheduler: Scheduler, token_ids: list[int], indices: list[int]) -> dict[int, int]:
    """Put blocks `indices` of the prompt's chain in the cache, with correct KV and no
    references (as if another request had computed them, or a transfer delivered them)."""
    hashes = block_hash_chain(token_ids, BS)
    seeds = block_seeds(ROOT_PARENT, token_ids, BS, len(hashes))
    seeded = {}
    for index in indices:
        (block_id,) = scheduler.blocks.allocate(1)
        tokens = token_ids[index * BS:(index + 1) * BS]
        scheduler.blocks.commit([block_id], [hashes[index]], tokens, hashes[index - 1] if index else None,
                                seeds=[seeds[index]])
        scheduler.pool.write_block(block_id, seeds[index], tokens)
        seeded[index] = block_id
    scheduler.blocks.free(list(seeded.values()))
    scheduler.blocks.take_events()
    return seeded


HOLES_PROMPT = prompt(5 * BS + 2)  # five full blocks and a 2-token tail


def test_admission_reuses_cached_blocks_behind_a_hole() -> None:
    scheduler = make_recording_scheduler()
    seeded = seed_cache(scheduler, HOLES_PROMPT, [0, 1, 3])
    scheduler.pool.written.clear()
    sampling = SamplingParams(max_tokens=3)
    scheduler.add_request("r", HOLES_PROMPT, sampling)
    result = scheduler.step(0.0)
    # Only blocks 2 and 4 and the tail are computed, in one step: 4 + 4 + 2 tokens.
    assert result.prefill_tokens == 10 and "r" in result.outputs
    block_ids = scheduler.block_ids("r")
    assert [block_ids[index] for index in (0, 1, 3)] == [seeded[0], seeded[1], seeded[3]]
    assert result.computed_blocks == {"r": [block_ids[2], block_ids[4]]}
    assert sorted(scheduler.pool.written) == sorted([block_ids[2], block_ids[4], block_ids[5]])
    # Block 3 was cached behind a hole, unannounced; computing block 2 announces it too.
    hashes = block_hash_chain(HOLES_PROMPT, BS)
    assert [(event.parent_block_hash, event.block_hashes, event.token_ids) for event in scheduler.blocks.take_events()
            ] == [(hashes[1], [hashes[2]], HOLES_PROMPT[8:12]), (hashes[2], [hashes[3]], HOLES_PROMPT[12:16]),
                  (hashes[3], [hashes[4]], HOLES_PROMPT[16:20])]
    tokens, finals, _ = run_to_completion(scheduler)
    assert result.outputs["r"].token_ids + tokens["r"] == generate_tokens(HOLES_PROMPT, sampling, VOCAB)[0]
    assert finals["r"].cached_tokens == 3 * BS
    load = scheduler.load()
    assert (load.cached_tokens_total, load.computed_prompt_tokens_total, load.kv_used_blocks) == (12, 10, 0)


@pytest.mark.parametrize(("budget", "prefill_steps", "computed_per_step"), [
    (4, [4, 4, 2], [[2], [4], []]),  # one hole per step, then the tail
    (6, [6, 4], [[2], [4]]),  # block 4 is split across steps; the chunk skips block 3
])
def test_chunked_prefill_walks_the_holes_and_the_budget_counts_computed_tokens(
        budget: int, prefill_steps: list[int], computed_per_step: list[list[int]]) -> None:
    scheduler = make_recording_scheduler(budget=budget)
    seed_cache(scheduler, HOLES_PROMPT, [0, 1, 3])
    scheduler.add_request("r", HOLES_PROMPT, SamplingParams(max_tokens=2))
    steps = []
    while "r" not in (steps[-1].outputs if steps else {}):
        steps.append(scheduler.step(float(len(steps))))
        block_ids = scheduler.block_ids("r")
        check_invariants(scheduler, steps[-1])
    assert [step.prefill_tokens for step in steps] == prefill_steps
    assert [step.computed_blocks.get("r", []) for step in steps] == [
        [block_ids[index] for index in indices] for indices in computed_per_step]
    assert scheduler.load().pending_prefill_tokens == 0
    run_to_completion(scheduler)
    assert scheduler.blocks.used_blocks == 0 and scheduler.computed_prompt_tokens_total == 10


def test_a_prompt_whose_only_cached_block_is_late_allocates_its_holes_at_once() -> None:
    scheduler = make_recording_scheduler(budget=4)
    seed_cache(scheduler, HOLES_PROMPT, [3])
    scheduler.add_request("r", HOLES_PROMPT, SamplingParams(max_tokens=1))
    result = scheduler.step(0.0)
    assert result.prefill_tokens == 4 and len(scheduler.block_ids("r")) == 4  # blocks 0-2 and the cached 3
    tokens, finals, _ = run_to_completion(scheduler)
    assert tokens["r"] == generate_tokens(HOLES_PROMPT, SamplingParams(max_tokens=1), VOCAB)[0]
    assert finals["r"].cached_tokens == BS and scheduler.computed_prompt_tokens_total == 4 * BS + 2


def test_clean_reused_kv_gives_the_reference_tokens_and_corrupt_kv_does_not() -> None:
    sampling = SamplingParams(max_tokens=6)
    text = prompt(6 * BS + 1)
    reference = generate_tokens(text, sampling, VOCAB)[0]
    scheduler = make_scheduler()
    scheduler.add_request("first", text, sampling)
    scheduler.add_request("fresh", prompt(6 * BS + 1, start=200), sampling)  # another prompt, for contrast
    tokens, _, _ = run_to_completion(scheduler)
    assert tokens["first"] == reference

    scheduler.add_request("clean", text, sampling)
    tokens, finals, _ = run_to_completion(scheduler)
    assert tokens["clean"] == reference and finals["clean"].cached_tokens == 6 * BS

    cached = scheduler.blocks.match_prefix(block_hash_chain(text, BS))
    view = scheduler.pool.block_view(cached[2])
    view[:7] = view[:7] ^ 0xFF  # a few flipped bytes in the middle of the prefix
    scheduler.add_request("corrupt", text, sampling)
    tokens, finals, _ = run_to_completion(scheduler)
    assert finals["corrupt"].cached_tokens == 6 * BS
    assert len(tokens["corrupt"]) == 6 and tokens["corrupt"] != reference
    assert scheduler.blocks.used_blocks == 0
