"""`unsubscribe_quietly`: every subscription is released, a failing one (its connection
going away) neither raises nor stops the others, a None is skipped."""

from __future__ import annotations

from shared.bus import unsubscribe_quietly


class FakeSubscription:
    def __init__(self, subject: str, fails: bool = False) -> None:
        self.subject = subject
        self.fails = fails
        self.released = False

    async def unsubscribe(self) -> None:
        if self.fails:
            raise ConnectionError("the connection is closed")
        self.released = True


async def test_every_subscription_is_released_past_a_failing_one_and_none() -> None:
    first, failing, last = FakeSubscription("a"), FakeSubscription("b", fails=True), FakeSubscription("c")
    await unsubscribe_quietly([first, None, failing, last], "test")  # type: ignore[list-item]
    assert first.released and last.released and not failing.released
