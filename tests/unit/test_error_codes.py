"""The error taxonomy (`shared.errors`): each kind declares its code once, and a `Failed`
frame's code comes back as that kind (`from_code`) with its HTTP status."""

from __future__ import annotations

import pytest

from shared.errors import HTTP_STATUS, Disconnected, ErrorCode, Reconnected, TandemError, from_code


@pytest.mark.parametrize("code", [code for code in ErrorCode if code is not ErrorCode.INTERNAL])
def test_a_code_comes_back_as_the_kind_that_declares_it(code: ErrorCode) -> None:
    error = from_code(code.value, "m")
    assert type(error) is not TandemError and type(error).code is code
    assert (error.code, error.message, error.http_status) == (code, "m", HTTP_STATUS[code])


def test_an_internal_or_unknown_code_is_the_base_kind() -> None:
    for code in ("internal", "no-such-code"):
        error = from_code(code, "m")
        assert type(error) is TandemError and error.code is ErrorCode.INTERNAL and error.http_status == 500


def test_a_kind_without_its_own_code_shares_its_parents_and_is_not_what_from_code_gives() -> None:
    assert Reconnected("m").code is ErrorCode.DISCONNECTED
    assert type(from_code("disconnected", "m")) is Disconnected
