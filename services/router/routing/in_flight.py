"""Counts of things in flight per key (pure): an API key's requests (`http.auth.limits`),
a fair-share key's queued and running requests (`routing.admission.fair_share`). A key
whose count drops to zero is removed, so the mapping holds only the keys with something in
flight."""

from __future__ import annotations


def end_one(counts: dict[str, int], key: str, what: str) -> None:
    """One of `key`'s things in flight ended; ending one that never began is a bug (`what`
    names it)."""
    held = counts.get(key, 0)
    assert held > 0, f"{what} of key {key!r} without one in flight"
    if held == 1:
        del counts[key]
    else:
        counts[key] = held - 1
