"""`end_one`: one of a key's things in flight ended; the key goes at zero."""

from __future__ import annotations

import pytest

from services.router.routing.in_flight import end_one


def test_a_key_counts_down_and_goes_at_zero() -> None:
    counts = {"a": 2, "b": 1}
    end_one(counts, "a", "a release")
    assert counts == {"a": 1, "b": 1}
    end_one(counts, "a", "a release")
    end_one(counts, "b", "a release")
    assert counts == {}


def test_ending_what_never_began_is_a_bug() -> None:
    with pytest.raises(AssertionError, match="a release of key 'x' without one in flight"):
        end_one({}, "x", "a release")
