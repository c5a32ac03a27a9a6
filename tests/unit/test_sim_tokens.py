"""Deterministic tokens: a function of the history, recomputable anywhere, seeded sampling."""

from __future__ import annotations

from services.worker.sim.tokens import fold_token, fold_tokens, generate_tokens, next_token
from shared.schemas.generate import SamplingParams

VOCAB = 1000
PROMPT = [17, 4, 250, 999, 3, 3, 81, 0, 1, 2, 640]


def test_same_history_same_tokens() -> None:
    greedy = SamplingParams(max_tokens=40)
    first, reason = generate_tokens(PROMPT, greedy, VOCAB)
    second, _ = generate_tokens(list(PROMPT), greedy, VOCAB)
    assert first == second and reason == "length" and len(first) == 40
    assert all(3 <= token < VOCAB for token in first)
    assert len(set(first)) > 20  # varied, not a constant stream
    assert generate_tokens(PROMPT[:-1] + [641], greedy, VOCAB)[0] != first


def test_state_can_be_recomputed_from_any_split() -> None:
    history = PROMPT + generate_tokens(PROMPT, SamplingParams(max_tokens=20), VOCAB)[0]
    whole = fold_tokens(history)
    for split in range(len(history) + 1):
        assert fold_tokens(history[split:], fold_tokens(history[:split])) == whole
    state = fold_tokens([])
    for token in history:
        state = fold_token(state, token)
    assert state == whole


def test_continuing_elsewhere_gives_the_same_completion() -> None:
    """A worker that got the prompt plus k generated tokens continues exactly the same way."""
    sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    full, _ = generate_tokens(PROMPT, sampling, VOCAB)
    for k in (1, 5, 11):
        rest, reason = generate_tokens(PROMPT + full[:k], SamplingParams(max_tokens=12 - k, temperature=0.8, seed=7),
                                       VOCAB)
        assert rest == full[k:] and reason == "length"


def test_seed_and_temperature_change_sampled_output() -> None:
    def run(**kwargs) -> list[int]:
        return generate_tokens(PROMPT, SamplingParams(max_tokens=16, **kwargs), VOCAB)[0]

    greedy = run()
    assert run(seed=1) == greedy and run(seed=2) == greedy  # greedy ignores the seed
    assert run(temperature=1.0, seed=1) == run(temperature=1.0, seed=1)
    assert run(temperature=1.0, seed=1) != run(temperature=1.0, seed=2)
    assert run(temperature=1.0, seed=1) != greedy
    assert run(temperature=0.5, seed=1) != run(temperature=1.0, seed=1)


def test_stop_token_ends_with_stop() -> None:
    reference, _ = generate_tokens(PROMPT, SamplingParams(max_tokens=30), VOCAB)
    stop_id = reference[5]
    stopped, reason = generate_tokens(PROMPT, SamplingParams(max_tokens=30, stop_token_ids=[stop_id]), VOCAB)
    assert reason == "stop"
    assert stopped == reference[:reference.index(stop_id) + 1]  # the stop token is part of the output


def test_never_emits_special_ids() -> None:
    state = fold_tokens(PROMPT)
    seen = set()
    for _ in range(200):
        token = next_token(state, SamplingParams(), vocab_size=5)
        seen.add(token)
        state = fold_token(state, token)
    assert seen == {3, 4}
