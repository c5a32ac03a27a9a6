"""Stop strings on streamed text. Pure.

The output ends just before the first occurrence of any stop string (the stop string
itself is not returned, as in OpenAI's API). Text that could be the beginning of a stop
string is held back until the next piece decides it, so a stream never shows a client
part of a stop string it later has to take back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stop_strings if stop)
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` (with earlier held-back text) that is safe to show now.

        After a stop string is found, `stopped` is True and every later push returns "".
        """
        if self.stopped:
            return ""
        if not self._stops:
            return text
        pending = self._pending + text
        matches = [index for index in (pending.find(stop) for stop in self._stops) if index >= 0]
        if matches:
            self.stopped = True
            self._pending = ""
            return pending[:min(matches)]
        hold = self._held_suffix(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold]

    def flush(self) -> str:
        """The held-back tail: the output ended without completing a stop string."""
        released, self._pending = self._pending, ""
        return released

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
