"""Stop strings on streamed text. Pure.

The output ends at the stop string that completes first (on a tie, the first listed, as
vLLM's server picks it): just before it (it is not returned, as in OpenAI's API), or just
after it with vLLM's `include_stop_str_in_output`. Text that could be the beginning of a
stop string is held back until the next piece decides it, so a stream never shows a client
part of a stop string it later has to take back; a stop string that is kept needs no
hold-back. As on vLLM's server, a stop string must end after the answer's first `min_tokens`
tokens (`push(search=False)` for those).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop_strings: Sequence[str], *, include: bool = False) -> None:
        self._stops = tuple(stop for stop in stop_strings if stop)
        self._include = include  # the stop string is the output's end, kept
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._pending = ""  # held back: may begin a stop string
        self._shown_tail = ""  # kept stop strings: the end of the text shown, where one may begin
        self.stopped = False

    def push(self, text: str, *, search: bool = True) -> str:
        """The part of `text` (with earlier held-back text) that is safe to show now. A stop
        string must end in `text`; none is looked for with `search` False (the answer's first
        `min_tokens` tokens, which vLLM's server never stops in).

        After a stop string is found, `stopped` is True and every later push returns "".
        """
        if self.stopped:
            return ""
        if not self._stops:
            return text
        before = len(self._shown_tail) + len(self._pending)
        pending = self._pending + text
        searched = self._shown_tail + pending
        matches = [(index + len(stop), order, index) for order, stop in enumerate(self._stops)
                   if search and (index := searched.find(stop, max(0, before - len(stop) + 1))) >= 0]
        if matches:
            end, _, start = min(matches)  # completes first; on a tie, listed first
            self.stopped = True
            self._pending = ""
            return pending[:(end if self._include else start) - len(self._shown_tail)]
        if self._include:  # nothing to take back: all of it is shown
            self._shown_tail = searched[len(searched) - self._longest + 1:]
            return pending
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
