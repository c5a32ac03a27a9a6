"""The routing sweep's workload family: seeded, grouped, sized from the engine shape."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench.routing.family import (
    DEFAULT_SWEEP,
    QUICK_SWEEP,
    SessionMaker,
    SweepPoint,
    arrival_times,
    lane_session,
    open_sessions,
    points_named,
    size_point,
    tenant_prefixes,
    warmup_sessions,
)
from bench.routing.workloads import EngineShape, answer_tokens
from services.worker.sim.profile import load_profile
from services.worker.sim.tokens import fold_tokens

VOCAB = 4000
SHAPE = EngineShape(workers=4, block_size=16, max_num_batched_tokens=512, max_model_len=2048,
                    profile=load_profile(""), sim_speedup=0.25)


def sessions(point: SweepPoint, seed: int = 0, duration_s: float = 10.0):
    return open_sessions(point, SHAPE, size_point(point, SHAPE), VOCAB, seed, duration_s)


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    point = SweepPoint("p", tenants=6, prefix_tokens=128, zipf=1.0, unique_share=0.3)
    assert sessions(point, seed=1) == sessions(point, seed=1)
    assert sessions(point, seed=1) != sessions(point, seed=2)
    maker = SessionMaker(point, SHAPE, VOCAB, 3)
    assert lane_session(maker, 2, 5) == lane_session(SessionMaker(point, SHAPE, VOCAB, 3), 2, 5)


def test_every_request_carries_its_group_and_shares_its_tenants_prefix() -> None:
    point = SweepPoint("p", tenants=5, prefix_tokens=96, query_tokens=16, unique_share=0.4)
    prefixes = tenant_prefixes(point, VOCAB, 0)
    generated = sessions(point, duration_s=20.0)
    groups = Counter(session.group for session in generated)
    assert set(groups) <= {None, *(f"tenant-{index}" for index in range(5))}
    assert abs(groups[None] / len(generated) - 0.4) < 0.1
    for session in generated:
        (turn,) = session.turns
        if session.group is None:
            assert not any(turn.prompt[:96] == prefix for prefix in prefixes)
            assert len(turn.prompt) >= 96 + 8
        else:
            tenant = int(session.group.split("-")[1])
            assert turn.prompt[:96] == prefixes[tenant] and 8 <= len(turn.prompt) - 96 <= 24


def test_zipf_popularity_skews_tenants_and_zero_is_uniform() -> None:
    assert SweepPoint("u", tenants=4).popularity() == pytest.approx([0.25] * 4)
    skewed = SweepPoint("z", tenants=8, prefix_tokens=32, query_tokens=4, zipf=1.2)
    shares = skewed.popularity()
    assert sum(shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True) and shares[0] > 3 * shares[7]
    counts = Counter(session.group for session in sessions(skewed, duration_s=60.0))
    total = sum(counts.values())
    assert counts["tenant-0"] / total == pytest.approx(shares[0], abs=0.06)
    assert sum(SweepPoint("m", tenants=4, unique_share=0.5).group_shares().values()) == pytest.approx(0.5)


def test_kv_pressure_sizes_the_pool_against_the_live_prefixes() -> None:
    for pressure in (0.3, 0.7, 1.2):
        point = SweepPoint("p", tenants=24, prefix_tokens=1024, kv_pressure=pressure)
        sizing = size_point(point, SHAPE)
        cluster_tokens = sizing.kv_tokens_per_worker * SHAPE.workers
        assert point.tenants * point.prefix_tokens / cluster_tokens == pytest.approx(pressure, rel=0.02)
    load = SweepPoint("p", tenants=8, load=0.5)
    assert size_point(load, SHAPE).rate_rps == pytest.approx(0.5 * SHAPE.cache_blind_capacity_rps(1024 + 64))


def test_bursts_keep_the_mean_rate_and_shape_the_arrivals() -> None:
    rng = np.random.default_rng(0)
    poisson = arrival_times(rng, SweepPoint("p"), 20.0, 50.0)
    onoff = arrival_times(rng, SweepPoint("o", arrivals="onoff", burst_on_s=1.0, burst_off_s=3.0), 20.0, 50.0)
    batch = arrival_times(rng, SweepPoint("b", arrivals="batch", batch_size=5), 20.0, 50.0)
    for times in (poisson, onoff, batch):
        assert len(times) / 50.0 == pytest.approx(20.0, rel=0.2) and times == sorted(times)
        assert all(0 <= at < 50.0 for at in times)
    assert all(at % 4.0 < 1.0 for at in onoff)  # nothing in the off windows
    assert len(batch) % 5 == 0 and all(len(set(batch[i:i + 5])) == 1 for i in range(0, len(batch), 5))


def test_a_conversations_next_turn_extends_the_last_with_the_predicted_answer() -> None:
    point = SweepPoint("c", tenants=0, prefix_tokens=64, query_tokens=8, max_tokens=6, turns=4, arrivals="closed")
    maker = SessionMaker(point, SHAPE, VOCAB, 0)
    conversation = next(session for session in (lane_session(maker, 0, index) for index in range(5)))
    assert conversation.group == "conv-1-0" and len(conversation.turns) == 4
    for before, after in zip(conversation.turns, conversation.turns[1:]):
        answer, _ = answer_tokens(fold_tokens(before.prompt), 6, VOCAB)
        assert after.prompt[:len(before.prompt) + 6] == before.prompt + answer
        assert 4 <= len(after.prompt) - len(before.prompt) - 6 <= 12
        assert after.think_s > 0
    sizing = size_point(point, SHAPE)
    assert sizing.users >= 1 and sizing.live_conversations == sizing.users
    assert sizing.conversation_tokens == 64 + 8 + 3 * (8 + 6) + 6


def test_warmup_is_one_request_per_tenant() -> None:
    point = SweepPoint("p", tenants=3, prefix_tokens=32)
    warm = warmup_sessions(point, VOCAB, 0)
    assert [session.group for session in warm] == ["tenant-0", "tenant-1", "tenant-2"]
    assert [session.turns[0].prompt[:32] for session in warm] == tenant_prefixes(point, VOCAB, 0)


@pytest.mark.parametrize("bad", [
    SweepPoint("x", arrivals="sometimes"),
    SweepPoint("x", tenants=2, turns=3),
    SweepPoint("x", tenants=0),
    SweepPoint("x", unique_share=1.5),
    SweepPoint("x", prefix_tokens=2000),
])
def test_points_that_cannot_run_are_refused(bad: SweepPoint) -> None:
    with pytest.raises(ValueError, match="point x"):
        bad.check(2048)


def test_the_default_sweep_spans_the_family() -> None:
    for point in DEFAULT_SWEEP:
        point.check(SHAPE.max_model_len)
    assert 6 <= len(DEFAULT_SWEEP) <= 10 and 2 <= len(QUICK_SWEEP) <= 3
    assert {0.3, 0.7, 1.2} <= {point.kv_pressure for point in DEFAULT_SWEEP}
    assert {"poisson", "onoff", "closed"} <= {point.arrivals for point in DEFAULT_SWEEP}
    assert any(point.turns > 1 for point in DEFAULT_SWEEP) and any(point.zipf > 0 for point in DEFAULT_SWEEP)
    assert any(point.unique_share >= 0.5 for point in DEFAULT_SWEEP)
    tenants = sorted(point.tenants for point in DEFAULT_SWEEP if point.tenants)
    assert tenants[0] <= 4 and tenants[-1] >= 24
    assert [point.name for point in points_named(["bursts", "roomy"])] == ["bursts", "roomy"]
    with pytest.raises(ValueError, match="unknown sweep points"):
        points_named(["nope"])
