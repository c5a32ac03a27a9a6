"""One error taxonomy for the whole system.

Each kind maps to an HTTP status (router) and travels on the wire as its `code` string
(request plane `Failed` frames). Expected failures are values on the wire; these
exceptions exist so that adapters can raise them and one handler can translate them.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"  # no worker can take the request now
    OVERLOADED = "overloaded"  # admission control: try later
    DISCONNECTED = "disconnected"  # worker vanished mid-request
    STREAM_GAP = "stream_gap"  # a response chunk was lost
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.OVERLOADED: 429,
    ErrorCode.DISCONNECTED: 502,
    ErrorCode.STREAM_GAP: 502,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
}


# Each kind of error by its code, filled as the kinds below are declared (`from_code`).
_BY_CODE: dict[ErrorCode, type[TandemError]] = {}


class TandemError(Exception):
    """The base of the taxonomy: a kind declares its code as a class keyword
    (`class NotFound(TandemError, code=ErrorCode.NOT_FOUND)`), which also makes it the kind
    `from_code` gives for that code; a subclass without one shares its parent's code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init_subclass__(cls, *, code: ErrorCode | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            assert code not in _BY_CODE, f"{code} is already {_BY_CODE[code].__name__}'s code"
            cls.code = code
            _BY_CODE[code] = cls

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]


class InvalidArgument(TandemError, code=ErrorCode.INVALID_ARGUMENT): ...


class NotFound(TandemError, code=ErrorCode.NOT_FOUND): ...


class Unavailable(TandemError, code=ErrorCode.UNAVAILABLE): ...


class Overloaded(TandemError, code=ErrorCode.OVERLOADED): ...


class Disconnected(TandemError, code=ErrorCode.DISCONNECTED): ...


class Reconnected(Disconnected):
    """The caller's own NATS connection was re-established: frames sent meanwhile may be lost.
    The worker is not at fault: a resumed request may go back to it."""


class StreamGap(TandemError, code=ErrorCode.STREAM_GAP): ...


class Timeout(TandemError, code=ErrorCode.TIMEOUT): ...


class Cancelled(TandemError, code=ErrorCode.CANCELLED): ...


def from_code(code: str, message: str) -> TandemError:
    try:
        kind = ErrorCode(code)
    except ValueError:
        return TandemError(message)
    return _BY_CODE.get(kind, TandemError)(message, code=kind)
