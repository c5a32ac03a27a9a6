"""What vLLM claims of a pull and what its worker side reads, for holder blocks of vLLM's
size, smaller and larger (`connector.vllm.pull_claim`, pure)."""

from __future__ import annotations

from connector.vllm.pull_claim import LoadPlan, claim_end, load_plan


def claim(held: int, prompt: int, computed: int, holder: int, local: int) -> int:
    return claim_end(usable_tokens=min(held, prompt - 1), computed_tokens=computed,
                     holder_block_size=holder, block_size=local)


def test_equal_block_sizes_claim_what_they_always_claimed() -> None:
    assert claim(1500, 1501, 0, 128, 128) == 1500  # a P/D decode: every held token, the tail included
    assert claim(1408, 1408, 0, 128, 128) == 1407  # never the last prompt token: it ends inside a block
    assert claim(1408, 1501, 1408, 128, 128) == 1408  # all cached here already: nothing
    plan = load_plan(computed_tokens=256, external_tokens=1244, holder_block_size=128, block_size=128)
    assert plan == LoadPlan(first_unit=2, units=10, tokens=1280, first_local=2, local_blocks=10)  # the tail read whole


def test_smaller_holder_blocks_read_whole_units_into_the_claimed_blocks() -> None:
    assert claim(1500, 1501, 0, 64, 128) == 1500
    plan = load_plan(computed_tokens=0, external_tokens=1407, holder_block_size=64, block_size=128)
    assert plan == LoadPlan(first_unit=0, units=22, tokens=1408, first_local=0, local_blocks=11)


def test_larger_holder_blocks_end_the_claim_where_a_unit_ends() -> None:
    assert claim(1500, 1501, 0, 128, 64) == 1408  # the partial tail block would not fit: computed here
    assert claim(1408, 1408, 0, 128, 64) == 1280  # 1407 would cut a unit: one block less is claimed
    assert claim(1408, 1501, 64, 128, 64) == 64  # cached up to the middle of a unit: nothing claimed
    plan = load_plan(computed_tokens=128, external_tokens=1280, holder_block_size=128, block_size=64)
    assert plan == LoadPlan(first_unit=1, units=10, tokens=1280, first_local=2, local_blocks=20)
