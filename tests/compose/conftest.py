"""Fixtures of the compose tests: a Docker engine (or a skip, or with CI=true a failure),
the Tandem image built from the repository, and a running default-profile stack per module.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from tests.compose.docker_stack import TEST_IMAGE, ComposeStack, base_image, engine_problem, prepare_context


@pytest.fixture(scope="session")
def docker_engine() -> None:
    problem = engine_problem()
    if problem and os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI needs a Docker engine for the compose tests: {problem}")
    if problem:
        pytest.skip(f"compose tests skipped: {problem}")


@pytest.fixture(scope="session")
def tandem_image(docker_engine: None) -> str:
    """The Tandem image, built through the compose file (cached layers make a rebuild quick)."""
    prepare_context()
    stack = ComposeStack(images={"TANDEM_IMAGE": TEST_IMAGE, "TANDEM_BASE_IMAGE": base_image()})
    started = time.monotonic()
    stack.compose("build", "model", timeout_s=1800)
    print(f"\nTandem image {TEST_IMAGE} built in {time.monotonic() - started:.1f} s")
    return TEST_IMAGE


@pytest.fixture(scope="module")
def sim_stack(tandem_image: str) -> Iterator[ComposeStack]:
    """`docker-compose up -d` of the default profile; NATS runs from the Tandem image."""
    stack = ComposeStack(images={"TANDEM_IMAGE": tandem_image, "TANDEM_NATS_IMAGE": tandem_image})
    try:
        started = time.monotonic()
        stack.up()
        print(f"\nstack {stack.project} ready in {time.monotonic() - started:.1f} s")
        yield stack
    finally:
        stack.down()
