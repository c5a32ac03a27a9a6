"""The router's KV view keeps one namespace per model (`services.router.kv.view`,
`services.router.kv.model_kv`): a worker's KV events land only in its model's index, and a
prompt of one model never matches blocks of another, even when both models' workers cached
the very same token ids (the same chain hashes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.router.kv.view import KvView
from shared.codec import MalformedCounter, encode
from shared.subjects import Subjects
from tests.unit.test_kv_index import BLOCK, FakeEngine, tokens


def deliver(kv_view: KvView, engine: FakeEngine, prompt: list[int]) -> None:
    """`engine`'s worker announces it cached `prompt`, through the view's bus callback."""
    message = SimpleNamespace(data=encode(engine.batch(engine.stored(prompt))), subject=f"kv.events.{engine.worker_id}")
    asyncio.run(kv_view._on_batch(message))  # type: ignore[arg-type]


def two_models() -> tuple[KvView, FakeEngine, FakeEngine]:
    kv_view = KvView(None, Subjects(), MalformedCounter())  # type: ignore[arg-type]  # no bus: callbacks only
    kv_view.worker_joined("a1", BLOCK, model="model-a")
    kv_view.worker_joined("b1", BLOCK, model="model-b")
    return kv_view, FakeEngine("a1", chain_hashes=True), FakeEngine("b1", chain_hashes=True)


def test_a_prompt_matches_only_its_own_models_workers() -> None:
    kv_view, worker_a, worker_b = two_models()
    prompt = tokens(1, 4 * BLOCK)
    deliver(kv_view, worker_a, prompt)
    assert kv_view.model("model-a").prompt_cache(prompt, now=0.0).cached_tokens == {"a1": 4 * BLOCK}
    assert kv_view.model("model-b").prompt_cache(prompt, now=0.0).cached_tokens == {}
    deliver(kv_view, worker_b, prompt)  # the same token ids cached by model B's worker too
    assert kv_view.model("model-a").prompt_cache(prompt, now=0.0).cached_tokens == {"a1": 4 * BLOCK}
    assert kv_view.model("model-b").prompt_cache(prompt, now=0.0).cached_tokens == {"b1": 4 * BLOCK}
    assert kv_view.stats().total_blocks == 8  # the same hashes, counted once per namespace


def test_predictions_stay_in_their_models_namespace() -> None:
    kv_view, _, _ = two_models()
    prompt = tokens(2, 2 * BLOCK)
    model_a = kv_view.model("model-a")
    model_a.predict("a1", model_a.prompt_cache(prompt, now=0.0), now=0.0, ttl_s=10.0)
    assert model_a.prompt_cache(prompt, now=1.0).cached_tokens == {"a1": 2 * BLOCK}
    model_b = kv_view.model("model-b")
    cache_b = model_b.prompt_cache(prompt, now=1.0)
    assert cache_b.cached_tokens == {}
    assert kv_view.of_worker("a1") is model_a and kv_view.of_worker("b1") is model_b


def test_a_worker_that_changes_model_leaves_its_old_namespace() -> None:
    kv_view, worker_a, _ = two_models()
    prompt = tokens(3, 2 * BLOCK)
    deliver(kv_view, worker_a, prompt)
    kv_view.worker_joined("a1", BLOCK, model="model-b")
    assert kv_view.model("model-a").prompt_cache(prompt, now=0.0).cached_tokens == {}
    assert kv_view.model("model-b").prompt_cache(prompt, now=0.0).cached_tokens == {}
    assert kv_view.of_worker("a1") is kv_view.model("model-b")
    kv_view.worker_left("a1")
    kv_view.worker_left("b1")
    assert kv_view.of_worker("a1") is None and kv_view.stats().workers == ()


def test_events_of_a_worker_that_is_no_member_are_dropped() -> None:
    kv_view, _, _ = two_models()
    stranger = FakeEngine("x1", chain_hashes=True)
    prompt = tokens(4, 2 * BLOCK)
    deliver(kv_view, stranger, prompt)
    assert kv_view.stats().total_blocks == 0
