"""The multi-turn workload's conversations and per-turn figures (pure parts of
`bench.serve.multiturn`)."""

from __future__ import annotations

import pytest

from bench.serve.conversations import ConversationSpec, TurnResult, build_conversations, next_prompt, turn_figures
from bench.serve.multiturn import _metric, _since


def test_conversations_are_seeded_distinct_and_independent_of_their_count() -> None:
    spec = ConversationSpec(conversations=3, turns=4, opening_tokens=50, user_tokens=10, seed=7)
    conversations = build_conversations(spec)
    assert conversations == build_conversations(spec)
    assert len({c.opening for c in conversations}) == 3 and all(len(c.messages) == 3 for c in conversations)
    assert all(len(c.opening.split()) == 50 and all(len(m.split()) == 10 for m in c.messages)
               for c in conversations)
    more = build_conversations(ConversationSpec(conversations=4, turns=4, opening_tokens=50, user_tokens=10, seed=7))
    assert more[:3] == conversations
    assert build_conversations(ConversationSpec(conversations=3, turns=4, opening_tokens=50, user_tokens=10,
                                                seed=8)) != conversations
    with pytest.raises(ValueError):
        ConversationSpec(conversations=1, turns=1, opening_tokens=5, user_tokens=5)


def test_a_turn_extends_the_previous_prompt() -> None:
    assert next_prompt([1, 2, 3], [4, 5], [6]) == [1, 2, 3, 4, 5, 6]


def test_turn_figures_separate_the_first_turn_from_the_rest() -> None:
    results = [TurnResult(conversation=c, turn=t, prompt_tokens=100 * t, answer_tokens=10, ttft_s=0.001 * t * (c + 1))
               for c in range(2) for t in (1, 2, 3)]
    results.append(TurnResult(conversation=2, turn=1, prompt_tokens=100, answer_tokens=0, ttft_s=None,
                              error="timeout"))
    figures = turn_figures(results)
    assert (figures["requests"], figures["errors"]) == (7, 1)
    assert figures["ttft_turn1_ms"]["count"] == 2 and figures["ttft_turn2plus_ms"]["count"] == 4
    assert figures["ttft_turn2plus_ms"]["p50"] == pytest.approx(3.5)
    assert figures["mean_prompt_tokens_turn2plus"] == 250.0
    assert figures["conversation_tokens"] == {"min": 310, "max": 310}


def test_counters_are_read_from_prometheus_text_and_differenced() -> None:
    text = ('tandem_kv_transfer_seconds_sum{kind="pull",role="decode"} 0.5\n'
            'tandem_kv_transfer_seconds_sum{kind="prefix_pull",role="prefill"} 0.25\n'
            'tandem_kv_transfer_seconds_count{kind="pull",role="decode"} 4.0\n'
            'tandem_router_prefix_pulls_total 3.0\n')
    assert _metric(text, "tandem_kv_transfer_seconds_sum", kind="pull") == 0.5
    assert _metric(text, "tandem_kv_transfer_seconds_sum") == 0.75
    assert _metric(text, "tandem_router_prefix_pulls_total") == 3.0
    assert _metric(text, "tandem_router_prefix_pulls") == 0.0
    since = _since({"n": 5.0, "pull": {"transfers": 4.0, "seconds": 0.5}},
                   {"n": 2.0, "pull": {"transfers": 2.0, "seconds": 0.1}})
    assert since == {"n": 3.0, "pull": {"transfers": 2.0, "seconds": 0.4, "mean_ms": 200.0}}
