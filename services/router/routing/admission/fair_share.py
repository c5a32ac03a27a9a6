"""Virtual token counters (VTC, "Fairness in Serving Large Language Models", OSDI '24). Pure.

Each key's counter grows with the tokens it was served, divided by its weight (output tokens
weigh `OUTPUT_WEIGHT` times an input token, as in the paper). The queue serves the key with
the least counter. A key that becomes active (nothing queued or running before) is lifted to
the least counter of the active keys, so idling earns no credit to burst with later.
"""

from __future__ import annotations

from services.router.routing.in_flight import end_one

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


def service_tokens(prompt_tokens: int, completion_tokens: int) -> float:
    """What serving a request costs, in input-token equivalents (before the key's weight)."""
    return INPUT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * completion_tokens


class VirtualTokenCounters:
    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # key -> its requests queued or running

    def counter(self, key: str) -> float:
        return self.counters.get(key, 0.0)

    def activate(self, key: str) -> None:
        """One more request of `key` queued or running; an idle key starts at the least active counter."""
        held = self._active.get(key, 0)
        if held == 0:
            floor = min((self.counters.get(other, 0.0) for other in self._active), default=None)
            if floor is not None:
                self.counters[key] = max(self.counter(key), floor)
        self._active[key] = held + 1

    def deactivate(self, key: str) -> None:
        end_one(self._active, key, "a deactivation")

    def charge(self, key: str, tokens: float, weight: float) -> None:
        """Count `tokens` served to `key` (negative: a correction of an estimate)."""
        assert weight > 0
        self.counters[key] = self.counter(key) + tokens / weight

    @property
    def active_keys(self) -> list[str]:
        return list(self._active)
