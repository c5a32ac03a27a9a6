"""The router's accept timeout must outlast a worker's hold of `Accepted`
(`shared.frame_sender.FrameSender`): a request still prefilling would look unaccepted."""

from __future__ import annotations

import pytest

from services.router.config import RouterConfig
from shared.config import ConfigError
from shared.schemas.generate import ACCEPT_HOLD_S


def test_an_accept_timeout_within_twice_the_hold_is_refused() -> None:
    for timeout in (ACCEPT_HOLD_S, 2 * ACCEPT_HOLD_S):
        with pytest.raises(ConfigError, match="accept timeout must be longer"):
            RouterConfig(accept_timeout_s=timeout).validate()
    RouterConfig(accept_timeout_s=4 * ACCEPT_HOLD_S).validate()
    RouterConfig().validate()  # the default, 2 s
