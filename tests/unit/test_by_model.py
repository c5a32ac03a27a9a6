"""`ByModel`: the per-model parts the router's KV view and placement keep, following
membership."""

from __future__ import annotations

from services.router.routing.by_model import ByModel


class Part:
    def __init__(self) -> None:
        self.members: set[str] = set()

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.members)

    def worker_left(self, worker_id: str) -> None:
        self.members.discard(worker_id)


def joined(parts: ByModel[Part], worker_id: str, model: str) -> Part:
    part = parts.join(worker_id, model)
    part.members.add(worker_id)
    return part


def test_each_model_has_its_part_and_each_worker_its_models() -> None:
    parts: ByModel[Part] = ByModel(Part)
    a, b = joined(parts, "w1", "a"), joined(parts, "w2", "b")
    assert a is not b and joined(parts, "w3", "a") is a
    assert parts.of_worker("w1") is a and parts.of_worker("w2") is b and parts.of_worker("nobody") is None
    assert parts.part("a") is a and set(parts.parts) == {"a", "b"}


def test_a_worker_serving_another_model_leaves_its_old_part_first() -> None:
    parts: ByModel[Part] = ByModel(Part)
    a = joined(parts, "w1", "a")
    joined(parts, "w2", "a")
    b = joined(parts, "w1", "b")
    assert a.worker_ids == ["w2"] and b.worker_ids == ["w1"] and parts.of_worker("w1") is b


def test_a_part_with_no_worker_left_is_dropped_and_made_anew() -> None:
    parts: ByModel[Part] = ByModel(Part)
    a = joined(parts, "w1", "a")
    parts.leave("w1")
    parts.leave("w1")  # twice, or never joined: nothing
    parts.leave("nobody")
    assert parts.parts == {} and parts.of_worker("w1") is None
    assert joined(parts, "w1", "a") is not a
