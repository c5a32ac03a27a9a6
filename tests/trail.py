"""The test that was running when a suite's process died (a pytest plugin).

A native crash (SIGABRT or SIGSEGV in a library loaded in the test process) ends pytest
before it reports anything, and only the tail of faulthandler's dump may survive in a CI
log. With `TANDEM_TEST_TRAIL` naming a file, each test's id and phase are written there
before it starts; the Makefile prints that file's content after a failed run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_TRAIL = os.environ.get("TANDEM_TEST_TRAIL")


def _mark(nodeid: str, phase: str) -> None:
    if _TRAIL:
        Path(_TRAIL).write_text(f"{nodeid} ({phase})\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _mark(item.nodeid, "setup")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _mark(item.nodeid, "call")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _mark(item.nodeid, "teardown")


def pytest_sessionfinish() -> None:
    _mark("(none: the session finished)", "after the last test")
